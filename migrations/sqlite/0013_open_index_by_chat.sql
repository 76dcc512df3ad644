-- Version 13: the index of work in flight keyed by chat before channel.
--
-- Every lane read and every status change of a reply in flight (a claim's lane, an
-- acknowledgement's finalization, the next reply's activation) walks this index by
-- (channel, chat). A channel is shared by many chats, so with the channel first every
-- comparison on the way down compared two texts, the channel equal almost every time;
-- with the chat first the first text decides almost every comparison. Lane reads name
-- both, so each is still one seek. The one read that names a channel alone, the
-- uncertain parts nobody has asked the platform about yet, has an index of its own
-- holding only uncertain replies.
DROP INDEX outbound_deliveries_open;
CREATE INDEX outbound_deliveries_open
    ON outbound_deliveries (chat_id, channel, status, id)
    WHERE status <> 'delivered' AND status <> 'failed';
CREATE INDEX outbound_deliveries_uncertain
    ON outbound_deliveries (channel, id) WHERE status = 'uncertain';
