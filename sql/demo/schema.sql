-- The demo schema (shared/DESIGN.md, "The demo pipeline"). Idempotent.
CREATE TABLE IF NOT EXISTS public.customers (
    id        bigint PRIMARY KEY,
    name      text NOT NULL,
    tier      text,
    tenant_id int
);

CREATE TABLE IF NOT EXISTS public.orders (
    id          bigint PRIMARY KEY,
    customer_id bigint REFERENCES public.customers (id),
    amount      numeric(12,2) NOT NULL,
    status      text NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now(),
    note        text
);
