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

-- The publication is owned by the administrator; pgcdc only reads it. A
-- partitioned table's changes go out under its own name (13 and later).
SELECT format('CREATE PUBLICATION %I FOR TABLE %s%s', :'publication', :'tables',
              CASE WHEN current_setting('server_version_num')::int >= 130000
                   THEN ' WITH (publish_via_partition_root = true)' ELSE '' END)
WHERE NOT EXISTS (SELECT 1 FROM pg_publication WHERE pubname = :'publication') \gexec

-- Tables without a primary key need an explicit replica identity; FULL is
-- the safe fallback (at the cost of whole old rows in WAL).
SELECT format('ALTER TABLE %s REPLICA IDENTITY FULL', c.oid::regclass)
FROM unnest(string_to_array(:'tables', ',')) t
JOIN pg_class c ON c.oid = to_regclass(trim(t))
WHERE c.relreplident = 'd'
  AND NOT EXISTS (SELECT 1 FROM pg_index i WHERE i.indrelid = c.oid AND i.indisprimary) \gexec
