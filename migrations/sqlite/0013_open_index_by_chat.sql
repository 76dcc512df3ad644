-- Version 13: the index of work in flight keyed by chat before channel.
--
-- Every lane read and every status change of a reply in flight (a claim's lane, an
-- acknowledgement's finalization, the next reply's activation) walks this index by
-- (channel, chat). A channel is shared by many chats, so with the channel first every
-- comparison on the way down compared two texts, the channel equal almost every time;
-- with the chat first the first text decides almost every comparison. Lane reads name
-- both, so each is still one seek. Of the reads that name a channel alone, the
-- uncertain parts nobody has asked the platform about yet (a dispatcher's) get an index
-- of their own holding only uncertain replies; a listing of a channel's work in flight
-- (the tool's and the console's) now reads the whole index instead of the channel's
-- part, as it sorts what it reads either way.
DROP INDEX outbound_deliveries_open;
CREATE INDEX outbound_deliveries_open
    ON outbound_deliveries (chat_id, channel, status, id)
    WHERE status <> 'delivered' AND status <> 'failed';
CREATE INDEX outbound_deliveries_uncertain
    ON outbound_deliveries (channel, id) WHERE status = 'uncertain';
