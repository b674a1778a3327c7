-- Set fields of a hash, unless the hash is gone (services/broker/store.py, BrokerStore.set_broker_state).
-- KEYS[1] the hash (a broker's config and timers).
-- ARGV field, value, field, value, ...
-- Returns nothing.
if redis.call('EXISTS', KEYS[1]) == 1 then redis.call('HSET', KEYS[1], unpack(ARGV)) end
