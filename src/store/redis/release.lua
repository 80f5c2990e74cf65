-- release.lua: the entry point that gives back in-flight slots taken by an admitted
-- concurrency check (concurrency.lua). A key that holds no concurrency state has nothing to
-- give back; a key whose last slot comes back is deleted, as good as fresh.
--
-- KEYS[1]: the key. ARGV[1]: the slots to give back.
-- Returns the slots still in flight.
local key = KEYS[1]
local cost = tonumber(ARGV[1])
local raw = redis.call('GET', key)
if not raw then
  return 0
end
local name, fields = decode(raw)
local state = name == 'concurrency' and algorithms.concurrency.load(fields)
if not state then
  return 0
end
state = algorithms.concurrency.release(state, cost)
if state.in_flight == 0 then
  redis.call('DEL', key)
else
  redis.call('SET', key, encode('concurrency', algorithms.concurrency.save(state)))
end
return state.in_flight
