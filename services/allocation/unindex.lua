-- Remove workload index entries that are still the ones given (services/allocation/store.py,
-- NodeStore.unindex): an entry written since, by a placement of the same id, stays.
-- KEYS[1] the workload index (hash: workload id -> `<node>/<tag>`). ARGV id, entry, id, entry, ...
for i = 1, #ARGV, 2 do
  if redis.call('HGET', KEYS[1], ARGV[i]) == ARGV[i + 1] then redis.call('HDEL', KEYS[1], ARGV[i]) end
end
return 0
