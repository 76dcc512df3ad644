-- chunked-outbox on PostgreSQL, schema version 5: the start of every transaction of
-- the crate in one call, planned once per session.
--
-- A transaction of the crate begins with its settings (the busy timeout as
-- lock_timeout, idle_in_transaction_session_timeout, no JIT or parallel plans and, in
-- a write, how it plans), the rules' lock and, read after that lock is granted, the
-- rules' version, the server's clock and the schema's version. Sent as a dozen
-- statements in one simple query, each was parsed and planned again at every BEGIN
-- (0.13 ms of a single enqueue's 0.9 ms); PL/pgSQL keeps its plans for the session.
--
-- p_rules_lock: 'shared' or 'exclusive' for a write (the rules' lock taken that way,
-- and the write's planning set), NULL for a read (neither). The settings are local to
-- the transaction (set_config(..., true)): nothing is left for the next client of a
-- pooler. The function has no SET clause, so that they outlive the call, and no
-- search_path of its own: it is the crate's, called on the outbox's search_path.
-- In READ COMMITTED each statement of a VOLATILE function takes its own snapshot: a
-- change of the rules committed while the lock was waited for is read.

-- The rules' lock, per schema: shared by every write, exclusive for a change of the
-- rules. The one spelling of its key: outbound_begin takes it, and so does the crate
-- when a transaction needs it again (exclusively).
CREATE FUNCTION outbound_lock_rules(p_exclusive boolean)
RETURNS void
LANGUAGE plpgsql VOLATILE
AS $fn$
BEGIN
    IF p_exclusive THEN
        PERFORM pg_advisory_xact_lock(hashtextextended(current_schema() || '/rules', 0));
    ELSE
        PERFORM pg_advisory_xact_lock_shared(hashtextextended(current_schema() || '/rules', 0));
    END IF;
END
$fn$;

CREATE FUNCTION outbound_begin(p_rules_lock text, p_lock_ms bigint, p_idle_ms bigint)
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
               (SELECT max(h.version) FROM outbound_schema_history h)::bigint
        FROM outbound_policy p WHERE p.id = 1;
END
$fn$;
