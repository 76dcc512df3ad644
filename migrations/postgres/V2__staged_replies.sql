-- chunked-outbox on PostgreSQL, schema version 2: replies enqueued inside the
-- application's own transaction ("staged"), and the function that enqueues them.
--
-- The application's transaction runs one statement of the crate, outbound_enqueue(),
-- which writes one row (status 'new', its chunk texts in new_chunks) and takes no lock
-- but that row's and its caller key's: a busy lane never holds up the application's
-- commit. The crate's own short transactions later make the row a delivery of its
-- lane (a row number drawn under the lane's lock, as every delivery's is), and keep
-- the staged row number it was known by in outbound_renumbered, so the uid the
-- application was given finds it.

ALTER TABLE outbound_deliveries DROP CONSTRAINT outbound_deliveries_status_check;
ALTER TABLE outbound_deliveries ADD CONSTRAINT outbound_deliveries_status_check
    CHECK (status IN ('queued', 'pending', 'partial', 'uncertain', 'failed', 'delivered',
                      'cancelled', 'unfinalized', 'new'));
-- A staged reply's chunks (NULL once it is a delivery of its lane).
ALTER TABLE outbound_deliveries ADD COLUMN new_chunks text[];
CREATE INDEX outbound_deliveries_staged ON outbound_deliveries (id) WHERE status = 'new';

-- The row number a staged reply had (its uid holds it), and the one it has now.
CREATE TABLE outbound_renumbered (
    old_id bigint PRIMARY KEY,
    new_id bigint NOT NULL
);
-- A purge removes the entry of the delivery it removes.
CREATE INDEX outbound_renumbered_new ON outbound_renumbered (new_id);

-- Enqueues a reply in the caller's transaction: one row, status 'new'. Returns the
-- reply's uid and whether it was made; for a caller key already used, the existing
-- reply's content (the crate compares it with the one given) instead.
--
-- p_uid_high, p_uid_spare: the parts of the uid the client draws (time, version, and
-- random bits; see DeliveryId in the crate); the row number and the database's salt
-- are filled in here.
CREATE FUNCTION outbound_enqueue(
    p_channel text, p_chat_id text, p_sender text, p_key text, p_text text,
    p_chunks text[], p_metadata text, p_not_before bigint, p_now bigint,
    p_uid_high bigint, p_uid_spare bigint)
RETURNS TABLE (uid text, created boolean, channel text, chat_id text, sender text,
               body text, metadata text, status text, chunks text[])
LANGUAGE plpgsql VOLATILE
SET search_path FROM CURRENT
AS $fn$
#variable_conflict use_column
DECLARE
    v_row bigint := nextval('outbound_deliveries_id_seq');
    v_hex text;
    v_uid text;
    v_found bigint;
BEGIN
    SELECT lpad(to_hex(p_uid_high), 16, '0') || lpad(to_hex(
               p_uid_spare | ((v_row # m.id_salt) & 562949953421311)), 16, '0')
      INTO v_hex FROM outbound_meta m WHERE m.id = 1;
    v_uid := substr(v_hex, 1, 8) || '-' || substr(v_hex, 9, 4) || '-' || substr(v_hex, 13, 4)
        || '-' || substr(v_hex, 17, 4) || '-' || substr(v_hex, 21, 12);
    INSERT INTO outbound_deliveries AS d
        (id, uid, channel, chat_id, sender, idempotency_key, status, chunk_count,
         created_at, updated_at, text, metadata, not_before, new_chunks)
    VALUES (v_row, v_uid, p_channel, p_chat_id, p_sender, p_key, 'new',
            cardinality(p_chunks), p_now, p_now, p_text, p_metadata, p_not_before, p_chunks)
    ON CONFLICT (channel, idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING;
    IF FOUND THEN
        PERFORM pg_notify('chunked_outbox_' || md5(current_schema()), 'staged');
        RETURN QUERY SELECT v_uid, true, NULL::text, NULL::text, NULL::text, NULL::text,
            NULL::text, NULL::text, NULL::text[];
        RETURN;
    END IF;
    -- The key names a reply made before (or by a transaction that committed while
    -- this one waited for it): its content, as the crate stores it.
    SELECT d.id INTO v_found FROM outbound_deliveries d
     WHERE d.channel = p_channel AND d.idempotency_key = p_key;
    RETURN QUERY
        SELECT d.uid, false, d.channel, d.chat_id, d.sender, d.text, d.metadata, d.status,
               CASE WHEN d.new_chunks IS NOT NULL THEN d.new_chunks
                    -- A queued reply of one chunk has its row made when it starts.
                    WHEN cardinality(s.texts) = 0 AND d.status = 'queued' THEN ARRAY[d.text]
                    ELSE s.texts END
          FROM outbound_deliveries d,
               LATERAL (SELECT ARRAY(SELECT coalesce(c.text, d.text)
                                       FROM outbound_delivery_chunks c
                                      WHERE c.delivery_id = d.id
                                      ORDER BY c.chunk_index) AS texts) s
         WHERE d.id = v_found;
END
$fn$;
