-- State of the built-in schema registry (`pgcdc registry`). Applied by the
-- registry at start-up; idempotent.
SET client_min_messages = warning;
CREATE SCHEMA IF NOT EXISTS pgcdc_registry;

-- One row per distinct schema. Ids are global across subjects, never reused,
-- and the same canonical schema always has the same id.
CREATE TABLE IF NOT EXISTS pgcdc_registry.schemas (
    id          serial PRIMARY KEY,
    schema_type text NOT NULL DEFAULT 'AVRO',
    -- sha256 of the canonical text: a btree cannot index large schemas.
    fingerprint bytea NOT NULL UNIQUE,
    canonical   text NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now()
);

-- Subject versions. A soft delete sets `deleted`; a permanent delete removes
-- the row (the schema and its id stay).
CREATE TABLE IF NOT EXISTS pgcdc_registry.versions (
    subject    text NOT NULL,
    version    int NOT NULL CHECK (version > 0),
    schema_id  int NOT NULL REFERENCES pgcdc_registry.schemas (id),
    deleted    boolean NOT NULL DEFAULT false,
    created_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (subject, version)
);
CREATE INDEX IF NOT EXISTS versions_by_schema ON pgcdc_registry.versions (schema_id);

-- Compatibility levels: subject '' is the global level.
CREATE TABLE IF NOT EXISTS pgcdc_registry.config (
    subject       text PRIMARY KEY,
    compatibility text NOT NULL
);
INSERT INTO pgcdc_registry.config (subject, compatibility) VALUES ('', 'BACKWARD')
ON CONFLICT (subject) DO NOTHING;
