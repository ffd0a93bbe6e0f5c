-- Source-side setup for a production database, run once by an administrator
-- with psql:
--
--   psql "$ADMIN_URL" -v role=pgcdc -v password='...' -v publication=pgcdc_demo \
--        -v tables='public.customers, public.orders' -f sql/setup.sql
--
-- It creates a least-privilege capture role (REPLICATION plus SELECT on the
-- captured tables only), the publication, and makes sure every captured
-- table has a usable replica identity. `pgcdc check` verifies the result.
\set ON_ERROR_STOP on

SELECT format('CREATE ROLE %I LOGIN REPLICATION PASSWORD %L', :'role', :'password')
WHERE NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = :'role') \gexec

SELECT format('GRANT USAGE ON SCHEMA %I TO %I', s, :'role')
FROM (SELECT DISTINCT split_part(trim(t), '.', 1) AS s
      FROM unnest(string_to_array(:'tables', ',')) t) schemas \gexec

SELECT format('GRANT SELECT ON %s TO %I', trim(t), :'role')
FROM unnest(string_to_array(:'tables', ',')) t \gexec

-- Tables without a primary key need an explicit replica identity before
-- they are published (Postgres then refuses their UPDATEs and DELETEs);
-- FULL is the safe fallback (at the cost of whole old rows in WAL). A
-- partitioned table's setting does not reach its partitions, which
-- Postgres checks: each partition (and inheritance child) gets its own.
WITH RECURSIVE tree AS (
    SELECT to_regclass(trim(t))::oid AS oid FROM unnest(string_to_array(:'tables', ',')) t
    UNION
    SELECT i.inhrelid FROM tree JOIN pg_inherits i ON i.inhparent = tree.oid)
SELECT format('ALTER TABLE %s REPLICA IDENTITY FULL', c.oid::regclass)
FROM tree JOIN pg_class c ON c.oid = tree.oid
WHERE c.relkind = 'r' AND c.relreplident = 'd'
  AND NOT EXISTS (SELECT 1 FROM pg_index i WHERE i.indrelid = c.oid AND i.indisprimary) \gexec

-- The publication is owned by the administrator; pgcdc only reads it. A
-- partitioned table's changes go out under its own name (13 and later).
SELECT format('CREATE PUBLICATION %I FOR TABLE %s%s', :'publication', :'tables',
              CASE WHEN current_setting('server_version_num')::int >= 130000
                   THEN ' WITH (publish_via_partition_root = true)' ELSE '' END)
WHERE NOT EXISTS (SELECT 1 FROM pg_publication WHERE pubname = :'publication') \gexec
