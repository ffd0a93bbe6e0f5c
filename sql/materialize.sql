-- State of `pgcdc materialize` in the target database. Idempotent.
CREATE SCHEMA IF NOT EXISTS pgcdc_state;

-- The position of a deleted key, so that a redelivered older change of it
-- is recognised and skipped. Swept after the redelivery window.
CREATE TABLE IF NOT EXISTS pgcdc_state.tombstones (
    mirror     text NOT NULL,
    key        text NOT NULL,
    commit_lsn bigint NOT NULL,
    seq        bigint NOT NULL,
    deleted_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (mirror, key)
);
CREATE INDEX IF NOT EXISTS tombstones_deleted_at ON pgcdc_state.tombstones (deleted_at);

-- The position of a mirror's last truncate: every change at or before it
-- is skipped.
CREATE TABLE IF NOT EXISTS pgcdc_state.truncations (
    mirror       text PRIMARY KEY,
    commit_lsn   bigint NOT NULL,
    seq          bigint NOT NULL,
    truncated_at timestamptz NOT NULL DEFAULT now()
);

-- This target's identity: the namespace of its entries in a shared (Redis)
-- dedup tier, so that a recreated target never trusts entries that
-- describe the old one.
CREATE TABLE IF NOT EXISTS pgcdc_state.identity (
    singleton boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    id        uuid NOT NULL DEFAULT gen_random_uuid()
);
INSERT INTO pgcdc_state.identity DEFAULT VALUES ON CONFLICT DO NOTHING;
