-- Finished deliveries by the time they finished (as on PostgreSQL since its version 1):
-- the console's charts of the last hour and day, and a purge of what is old enough,
-- read only those rows instead of the whole history.
CREATE INDEX outbound_deliveries_finished
    ON outbound_deliveries (finished_at) WHERE finished_at IS NOT NULL;
