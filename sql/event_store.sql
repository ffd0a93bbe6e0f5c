-- The event store: an append-only log of domain events in Postgres, one
-- stream per aggregate. pgcdc captures it through the same slot as the CRUD
-- tables and routes it to domain-event topics (`[outbox."event_store.events"]`).
--
--   unique (stream_id, version)  optimistic concurrency: two writers that
--                                read the same version cannot both append
--   events_append_only           updates, deletes and truncates are refused
--
-- `global_position` orders the whole store (insertion order; a rebuild
-- replays in it). Within a stream, versions are also commit order.
CREATE SCHEMA IF NOT EXISTS event_store;

CREATE TABLE IF NOT EXISTS event_store.events (
    global_position bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    event_id        uuid NOT NULL DEFAULT gen_random_uuid() UNIQUE,
    -- The aggregate type ("payment", "account"): the default route.
    stream_type     text NOT NULL,
    stream_id       text NOT NULL,
    version         bigint NOT NULL CHECK (version > 0),
    event_type      text NOT NULL,
    schema_version  int NOT NULL DEFAULT 1 CHECK (schema_version > 0),
    payload         jsonb NOT NULL,
    -- correlation_id, causation_id, actor and intent (the why).
    metadata        jsonb NOT NULL DEFAULT '{}' CHECK (jsonb_typeof(metadata) = 'object'),
    recorded_at     timestamptz NOT NULL DEFAULT clock_timestamp(),
    UNIQUE (stream_id, version)
);

CREATE OR REPLACE FUNCTION event_store.refuse_change() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'event_store.events is append-only: % is refused', TG_OP
        USING ERRCODE = 'restrict_violation',
              HINT = 'correct a stream by appending a compensating event';
END
$$;

DROP TRIGGER IF EXISTS events_append_only ON event_store.events;
CREATE TRIGGER events_append_only
    BEFORE UPDATE OR DELETE ON event_store.events
    FOR EACH ROW EXECUTE FUNCTION event_store.refuse_change();
DROP TRIGGER IF EXISTS events_no_truncate ON event_store.events;
CREATE TRIGGER events_no_truncate
    BEFORE TRUNCATE ON event_store.events
    FOR EACH STATEMENT EXECUTE FUNCTION event_store.refuse_change();
