-- Version 8: a resend that a platform's deduplication window allows (Discord's nonce,
-- LINE's retry key, a Matrix transaction id) carries the window's deadline.
--
-- resend_by: the time (ms, the server's clock) by which the part's resend must be
-- claimed, a margin before the platform forgets the first send; a claim at or after it
-- holds the part as uncertain instead of sending it (sent then, it could be posted
-- twice). NULL: no deadline (a resend after a lookup found nothing, a person's, any
-- other send).
ALTER TABLE outbound_delivery_chunks ADD COLUMN resend_by bigint;
