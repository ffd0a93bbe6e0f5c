-- A few demo rows. Idempotent: re-running changes nothing.
INSERT INTO public.customers (id, name, tier, tenant_id) VALUES
    (1, 'Ada Lovelace', 'gold', 1),
    (2, 'Grace Hopper', 'silver', 1),
    (3, 'Edsger Dijkstra', NULL, 2)
ON CONFLICT (id) DO NOTHING;

INSERT INTO public.orders (id, customer_id, amount, status, note) VALUES
    (1001, 1, 120.50, 'paid', NULL),
    (1002, 1, 35.00, 'shipped', 'gift wrap'),
    (1003, 2, 999.99, 'pending', NULL),
    (1004, 3, 12.00, 'paid', NULL)
ON CONFLICT (id) DO NOTHING;
