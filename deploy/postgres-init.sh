#!/usr/bin/env bash
# First-start setup of the compose Postgres (runs over the local socket, before
# the server listens on TCP): the capture role, the source and target
# databases, and the demo schema in the source.
set -euo pipefail
psql -v ON_ERROR_STOP=1 --username "$POSTGRES_USER" <<SQL
CREATE ROLE pgcdc LOGIN REPLICATION CREATEDB PASSWORD '${PGCDC_DB_PASSWORD}';
CREATE DATABASE pgcdc_source OWNER pgcdc;
CREATE DATABASE pgcdc_target OWNER pgcdc;
SQL
psql -v ON_ERROR_STOP=1 --username pgcdc --dbname pgcdc_source \
  -f /pgcdc-sql/demo/schema.sql -f /pgcdc-sql/demo/seed.sql
