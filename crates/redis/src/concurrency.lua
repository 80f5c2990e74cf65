-- concurrency.lua: the twin of crates/core/src/limit/concurrency.rs, a fixed number of in-flight slots,
-- held as LEASES so that slots never leak when a server instance dies.
--
-- Every admission that takes slots names a lease (a random id chosen by the instance) and how
-- long it lasts; the instance renews the leases it still holds (renew.lua) well before they
-- run out, and gives them back when the work ends (release.lua). A lease that is neither
-- renewed nor given back — its instance crashed — expires, and its slots are free again.
-- In flight = the units of the leases not yet expired. A refusal's retry_after is 0: a slot
-- frees when a holder finishes, which no clock can tell.
--
-- State: "concurrency <lease> <units> <expires_us> <lease> <units> <expires_us> ...". The key's
-- TTL is the last lease's expiry, so a key whose every holder vanished goes away by itself.
-- `limiter.lease` and `limiter.lease_us` (set by decide.lua) name the admission's lease.
local function live_leases(state, now_us)
  local live = {}
  for _, lease in ipairs(state.leases) do
    if lease.expires_us > now_us then
      live[#live + 1] = lease
    end
  end
  return live
end

-- The leases without the one named `id`.
local function without_lease(leases, id)
  local kept = {}
  for _, lease in ipairs(leases) do
    if lease.id ~= id then
      kept[#kept + 1] = lease
    end
  end
  return kept
end

local function units_of(leases)
  local units = 0
  for _, lease in ipairs(leases) do
    units = units + lease.units
  end
  return units
end

definitions.concurrency = function()
  return {
    load = function(fields)
      if #fields % 3 ~= 0 then
        return nil
      end
      local leases = {}
      for i = 1, #fields, 3 do
        leases[#leases + 1] = { id = fields[i], units = fields[i + 1], expires_us = fields[i + 2] }
      end
      return { leases = leases }
    end,

    save = function(state)
      local fields = {}
      for _, lease in ipairs(state.leases) do
        fields[#fields + 1] = lease.id
        fields[#fields + 1] = lease.units
        fields[#fields + 1] = lease.expires_us
      end
      return fields
    end,

    fresh = function()
      return { leases = {} }
    end,

    acquire = function(limiter, state, now_us, cost)
      local leases = live_leases(state, now_us)
      local in_flight = units_of(leases)
      local allowed = in_flight + cost <= limiter.capacity
      local charged = nil
      if allowed and cost > 0 then
        in_flight = in_flight + cost
        local expires_us = now_us + limiter.lease_us
        local merged = false
        for _, lease in ipairs(leases) do
          -- Two checks of one admission on the same key share its lease.
          if lease.id == limiter.lease then
            lease.units, lease.expires_us, merged = lease.units + cost, expires_us, true
          end
        end
        if not merged then
          leases[#leases + 1] = { id = limiter.lease, units = cost, expires_us = expires_us }
        end
        charged = { leases = leases }
      end
      return {
        allowed = allowed,
        limit = limiter.capacity,
        -- Saturating: a cap lowered under held slots must not go negative.
        remaining = math.max(limiter.capacity - in_flight, 0),
        retry_after = 0,
        reset_after = 0,
      }, charged
    end,

    -- An operator's refund: `units` slots given back from the newest live leases, as Rust's
    -- release takes them off the count.
    refund = function(_, state, now_us, units)
      local leases = live_leases(state, now_us)
      local left = units
      while left > 0 and #leases > 0 do
        local newest = leases[#leases]
        local taken = math.min(newest.units, left)
        newest.units, left = newest.units - taken, left - taken
        if newest.units == 0 then
          leases[#leases] = nil
        end
      end
      return { leases = leases }
    end,

    forget_after = function(_, state, now_us)
      local last = now_us
      for _, lease in ipairs(state.leases) do
        last = math.max(last, lease.expires_us)
      end
      return (last - now_us) * 1000
    end,
  }
end

-- Writes a concurrency state back with its TTL at the last lease's expiry, or deletes it.
local function store_leases(key, state, now_us)
  state.leases = live_leases(state, now_us)
  local after = algorithms.concurrency.forget_after(nil, state, now_us)
  if after <= 0 then
    redis.call('DEL', key)
  else
    redis.call('SET', key, encode('concurrency', algorithms.concurrency.save(state)), 'PX',
      math.max(ceil_div(after, 1000000), 1))
  end
end

-- The concurrency state of `key`, or a fresh one.
local function load_leases(key)
  local raw = redis.call('GET', key)
  if raw then
    local name, fields = decode(raw)
    local state = name == 'concurrency' and algorithms.concurrency.load(fields)
    if state then
      return state
    end
  end
  return algorithms.concurrency.fresh()
end
