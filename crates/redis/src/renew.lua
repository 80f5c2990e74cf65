-- renew.lua: the entry point that extends the leases an instance still holds (concurrency.lua),
-- so that the slots of work still running never expire under it.
--
-- A lease that expired (the instance could not reach Redis for a whole lease, or Redis lost its
-- data) is taken again, as its work still runs, but only if the cap has room for it: a renewal
-- never puts a key above its capacity (other work may have taken the slots meanwhile; the lease
-- is then lost, and the instance stops renewing it). A lease that was given back (release.lua
-- leaves a tombstone of 0 units for a lease duration) is never taken again, so a renewal that
-- reaches Redis after the release cannot resurrect it.
--
-- KEYS: one per held lease. ARGV[1]: lease duration (us); then three per key: lease, units,
-- the key's capacity.
-- Returns one status per key: 0 renewed, 1 taken again, 2 given back already, 3 lost (expired,
-- and the cap has no room for it).
local now_us = read_now('')
local lease_us = tonumber(ARGV[1])
local statuses = {}
for i, key in ipairs(KEYS) do
  local lease = tonumber(ARGV[3 * i - 1])
  local units = tonumber(ARGV[3 * i])
  local capacity = tonumber(ARGV[3 * i + 1])
  local state = load_leases(key)
  state.leases = live_leases(state, now_us)
  local status = nil
  for _, held in ipairs(state.leases) do
    if held.id == lease then
      if held.units == 0 then
        status = 2
      else
        held.expires_us, status = now_us + lease_us, 0
      end
    end
  end
  if not status then
    if units_of(state.leases) + units <= capacity then
      state.leases[#state.leases + 1] = { id = lease, units = units, expires_us = now_us + lease_us }
      status = 1
    else
      status = 3
    end
  end
  if status <= 1 then
    store_leases(key, state, now_us)
  end
  statuses[i] = status
end
return statuses
