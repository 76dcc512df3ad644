-- chunked-outbox on PostgreSQL, schema version 4: staged replies checked as the crate
-- checks them, and started in the order their transactions committed.
--
-- outbound_enqueue() accepted what the crate's own validation refuses (20,000 chunks
-- was accepted, and then every claim failed on the chunk index); it now refuses it,
-- with SQLSTATE 22023 and the reason, in the caller's transaction. The limits are the
-- crate's (chunked_outbox::limits); a row that still cannot be started (written some
-- other way) is set aside by the crate as a corrupt row, never retried.
--
-- A staged reply's place among the replies staged in its lane is drawn when its
-- transaction commits (a deferred trigger, under a lock of the lane's staged replies
-- that only other staging commits of the same lane wait for), not when the function
-- was called: two transactions that stage replies to one chat have them sent in the
-- order they committed.

CREATE FUNCTION outbound_check_reply(
    p_channel text, p_chat_id text, p_sender text, p_key text, p_text text,
    p_chunks text[], p_metadata text)
RETURNS void
LANGUAGE plpgsql IMMUTABLE
AS $fn$
DECLARE
    v_blank constant text := '^[[:space:]]*$';
    v_why text;
BEGIN
    v_why := CASE
        WHEN p_channel IS NULL OR p_channel ~ v_blank THEN 'channel: must not be empty or whitespace'
        WHEN octet_length(p_channel) > 128 THEN 'channel: longer than the limit of 128 bytes'
        WHEN p_channel ~ '[\u0001-\u001f\u007f-\u009f]' THEN 'channel: must not contain control characters'
        WHEN p_chat_id IS NULL OR p_chat_id ~ v_blank THEN 'chat id: must not be empty or whitespace'
        WHEN octet_length(p_chat_id) > 512 THEN 'chat id: longer than the limit of 512 bytes'
        WHEN p_key ~ v_blank THEN 'idempotency key: must not be empty or whitespace'
        WHEN octet_length(p_key) > 1024 THEN 'idempotency key: longer than the limit of 1024 bytes'
        WHEN p_sender ~ v_blank THEN 'sender: must not be empty or whitespace'
        WHEN octet_length(p_sender) > 1024 THEN 'sender: longer than the limit of 1024 bytes'
        WHEN octet_length(p_metadata) > 16384 THEN 'metadata: longer than the limit of 16384 bytes'
        WHEN p_text IS NULL OR p_text ~ v_blank THEN 'text: must not be empty or whitespace'
        WHEN coalesce(cardinality(p_chunks), 0) = 0 THEN 'chunks: a delivery needs at least one chunk'
        WHEN cardinality(p_chunks) > 10000 THEN
            format('chunks: %s chunks is more than the limit of 10000', cardinality(p_chunks))
        WHEN EXISTS (SELECT 1 FROM unnest(p_chunks) c WHERE c IS NULL OR c ~ v_blank) THEN
            'chunks: a chunk is empty or whitespace; platforms reject empty messages'
        WHEN octet_length(p_text) + (SELECT sum(octet_length(c)) FROM unnest(p_chunks) c)
             > 16777216 THEN 'text: more than the limit of 16777216 bytes'
    END;
    IF v_why IS NOT NULL THEN
        RAISE EXCEPTION 'outbound_enqueue refused the reply: %', v_why
            USING ERRCODE = '22023';
    END IF;
END
$fn$;

CREATE OR REPLACE FUNCTION outbound_enqueue(
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
    v_row bigint;
    v_hex text;
    v_uid text;
    v_found bigint;
BEGIN
    PERFORM outbound_check_reply(p_channel, p_chat_id, p_sender, p_key, p_text, p_chunks,
                                 p_metadata);
    v_row := nextval('outbound_deliveries_id_seq');
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
    SELECT d.id INTO v_found FROM outbound_deliveries d
     WHERE d.channel = p_channel AND d.idempotency_key = p_key;
    RETURN QUERY
        SELECT d.uid, false, d.channel, d.chat_id, d.sender, d.text, d.metadata, d.status,
               CASE WHEN d.new_chunks IS NOT NULL THEN d.new_chunks
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

-- The order in which staged replies' transactions committed, per lane.
CREATE SEQUENCE outbound_staged_order;
ALTER TABLE outbound_deliveries ADD COLUMN staged_order bigint;

CREATE FUNCTION outbound_staged_committing() RETURNS trigger
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $fn$
BEGIN
    -- Held until this transaction has committed: the next staging commit of the lane
    -- draws its place after this one's is visible.
    PERFORM pg_advisory_xact_lock(hashtextextended(
        current_schema() || '/staged/' || length(NEW.channel) || '/' || NEW.channel
        || NEW.chat_id, 0));
    UPDATE outbound_deliveries SET staged_order = nextval('outbound_staged_order')
     WHERE id = NEW.id AND status = 'new';
    RETURN NULL;
END
$fn$;

CREATE CONSTRAINT TRIGGER outbound_staged_commit_order
    AFTER INSERT ON outbound_deliveries
    DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW WHEN (NEW.status = 'new')
    EXECUTE FUNCTION outbound_staged_committing();
