-- The ledger scenario's CRUD side: accounts and payments, updated in place.
-- `status_day` is the business day of the last status change (so a
-- reversal overwrites the day a payment settled), and `reason` is filled
-- in only by the application versions that record why a payment was
-- reversed. tests/ledger/ drives it; the event-sourced side writes to
-- sql/event_store.sql in the same transactions.
CREATE TABLE IF NOT EXISTS public.accounts (
    id bigint PRIMARY KEY,
    customer text NOT NULL
);

CREATE TABLE IF NOT EXISTS public.payments (
    id bigint PRIMARY KEY,
    account_id bigint NOT NULL REFERENCES public.accounts (id),
    amount numeric(12,2) NOT NULL,
    currency text NOT NULL,
    status text NOT NULL CHECK (status IN ('initiated', 'settled', 'reversed')),
    status_day int NOT NULL,
    flag_rule text,
    reason text
);

-- Before images in the changelog: a consumer that needs the history (which
-- status a change left) reads it from `before`.
ALTER TABLE public.payments REPLICA IDENTITY FULL;
