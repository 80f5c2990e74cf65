-- renew.lua: the entry point that extends the leases an instance still holds (concurrency.lua),
-- so that the slots of work still running never expire under it. A lease that did expire (the
-- instance could not reach Redis for a whole lease) is taken again: the work is still running,
-- and its slots must count.
--
-- KEYS: one per held lease. ARGV[1]: lease duration (us); then two per key: lease, units.
-- Returns how many leases had expired and were taken again.
local now_us = read_now('')
local lease_us = tonumber(ARGV[1])
local retaken = 0
for i, key in ipairs(KEYS) do
  local lease = tonumber(ARGV[2 * i])
  local units = tonumber(ARGV[2 * i + 1])
  local state = load_leases(key)
  local found = false
  for _, held in ipairs(state.leases) do
    if held.id == lease and held.expires_us > now_us then
      held.expires_us, found = now_us + lease_us, true
    end
  end
  if not found then
    state.leases = without_lease(state.leases, lease)
    state.leases[#state.leases + 1] = { id = lease, units = units, expires_us = now_us + lease_us }
    retaken = retaken + 1
  end
  store_leases(key, state, now_us)
end
return retaken
