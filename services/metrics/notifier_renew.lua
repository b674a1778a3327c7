-- Extend a notifier registration by its own lease (services/metrics/notifier_store.py,
-- Registrations.renew).
-- KEYS[1] the registration, a hash: ref, lease_ms; it expires with its lease.
-- No ARGV.
-- Returns the lease in ms, or false if the registration has ended.
local lease_ms = redis.call('HGET', KEYS[1], 'lease_ms')
if not lease_ms then return false end
redis.call('PEXPIRE', KEYS[1], lease_ms)
return lease_ms
