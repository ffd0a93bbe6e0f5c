-- Least-privilege roles for pgcdc. Idempotent; run as a superuser (or a
-- role with CREATEROLE that owns the captured tables).
--
--   pgcdc_connector     LOGIN REPLICATION: `pgcdc run`. SELECT on the
--                       captured tables and nothing else; it owns nothing,
--                       so the publication is created here, by the DBA.
--   pgcdc_materializer  LOGIN: `pgcdc materialize`, `pgcdc rebuild`,
--                       `pgcdc dlq`. CONNECT and CREATE on the target
--                       database, so it creates and owns its own schemas
--                       (mirrors, read models, pgcdc_state, ...); no rights
--                       on the source.
--
-- Neither gets a password here: set one with ALTER ROLE ... PASSWORD (or
-- use certificates), and keep it out of the config file with
-- "${ENV_VAR}" references.
--
-- In the source database:
--   \i sql/roles.sql
--   SELECT pgcdc_admin.grant_capture('pgcdc_connector', 'demo',
--                                    ARRAY['public.customers', 'public.orders']);
-- In the target database:
--   \i sql/roles.sql
--   SELECT pgcdc_admin.grant_apply('pgcdc_materializer');

DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'pgcdc_connector') THEN
        CREATE ROLE pgcdc_connector LOGIN REPLICATION;
    END IF;
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'pgcdc_materializer') THEN
        CREATE ROLE pgcdc_materializer LOGIN;
    END IF;
EXCEPTION WHEN unique_violation OR duplicate_object THEN
    NULL; -- created by a concurrent run
END $$;

CREATE SCHEMA IF NOT EXISTS pgcdc_admin;
REVOKE ALL ON SCHEMA pgcdc_admin FROM PUBLIC;

-- What `pgcdc run` needs in the source database: the schemas' USAGE, SELECT
-- on each captured table (the snapshot and the catalog look-ups), and a
-- publication of exactly those tables (created here: a FOR TABLE
-- publication needs ownership of the tables, which the connector has not).
-- Identifiers are quoted with format('%I'), tables cast to regclass, so no
-- name can inject SQL. `tables` are SQL names (unquoted parts fold to lower
-- case): write 'public."Orders"' for what source.tables calls public.Orders.
CREATE OR REPLACE FUNCTION pgcdc_admin.grant_capture(
    role name, publication name, tables text[]
) RETURNS void LANGUAGE plpgsql AS $$
DECLARE
    t regclass;
    tables_sql text := '';
BEGIN
    EXECUTE format('GRANT CONNECT ON DATABASE %I TO %I', current_database(), role);
    FOREACH t IN ARRAY tables::regclass[] LOOP
        EXECUTE format('GRANT USAGE ON SCHEMA %I TO %I',
            (SELECT nspname FROM pg_namespace n JOIN pg_class c ON c.relnamespace = n.oid WHERE c.oid = t),
            role);
        EXECUTE format('GRANT SELECT ON TABLE %s TO %I', t, role);
        tables_sql := tables_sql || CASE WHEN tables_sql = '' THEN '' ELSE ', ' END || t::text;
    END LOOP;
    IF NOT EXISTS (SELECT 1 FROM pg_publication WHERE pubname = publication) THEN
        -- A partitioned table's changes under its own name (13 and later).
        EXECUTE format('CREATE PUBLICATION %I FOR TABLE %s%s', publication, tables_sql,
            CASE WHEN current_setting('server_version_num')::int >= 130000
                 THEN ' WITH (publish_via_partition_root = true)' ELSE '' END);
    END IF;
END $$;

-- What `pgcdc materialize` needs in the target database: to connect, and to
-- create its schemas (it owns what it creates, and nothing else).
CREATE OR REPLACE FUNCTION pgcdc_admin.grant_apply(role name) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    EXECUTE format('GRANT CONNECT, CREATE ON DATABASE %I TO %I', current_database(), role);
END $$;
