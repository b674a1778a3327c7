-- The tests' script (tests/test_redis_pipelined.py, tests/test_redis_functions.py): count.
-- KEYS[1] a counter.
-- Returns the counter after adding 1.
return redis.call('INCR', KEYS[1])
