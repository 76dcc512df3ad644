-- Version 9: a schema says which builds may still write it.
--
-- `writable_from` is the oldest schema version whose build may still write this
-- schema: every later migration that keeps the statements of older builds correct (an
-- expand step: new columns with defaults, old statements' effects completed) leaves it
-- where it is, so a process of an older release keeps enqueueing and sending through a
-- rolling upgrade; only a contract step, which drops what older builds rely on, raises
-- it. Each write's opening reads it (outbound_begin's third column, which named the
-- schema's version until now), so a process the schema no longer accepts stops before
-- it writes. `migrated_by` names the release that last migrated the schema: the one to
-- upgrade to.
ALTER TABLE outbound_policy ADD COLUMN writable_from bigint NOT NULL DEFAULT 9;
ALTER TABLE outbound_meta ADD COLUMN migrated_by text NOT NULL DEFAULT '';

CREATE OR REPLACE FUNCTION outbound_begin(p_rules_lock text, p_lock_ms bigint, p_idle_ms bigint)
RETURNS TABLE (rules_version bigint, server_ms bigint, schema_version bigint)
LANGUAGE plpgsql VOLATILE
AS $fn$
BEGIN
    PERFORM set_config('lock_timeout', p_lock_ms::text, true),
            set_config('idle_in_transaction_session_timeout', p_idle_ms::text, true),
            set_config('jit', 'off', true),
            set_config('max_parallel_workers_per_gather', '0', true);
    IF p_rules_lock IS NULL THEN
        RETURN;
    END IF;
    -- A write runs each statement's generic plan, made once per connection, with the
    -- plans that read whole tables priced out (see the crate's write_planning).
    PERFORM set_config('plan_cache_mode', 'force_generic_plan', true),
            set_config('enable_seqscan', 'off', true),
            set_config('enable_mergejoin', 'off', true),
            set_config('enable_hashjoin', 'off', true);
    PERFORM outbound_lock_rules(p_rules_lock = 'exclusive');
    RETURN QUERY
        SELECT p.version,
               (extract(epoch FROM clock_timestamp()) * 1000)::int8,
               p.writable_from
        FROM outbound_policy p WHERE p.id = 1;
END
$fn$;
