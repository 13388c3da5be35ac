-- tollgate regional shares of a hot client: flush one region's demand, and once a period
-- turn every region's demand into new shares of the plan. Runs in the global store; any
-- gateway may call it, the first call in a period does the work, the others read.
--
-- KEYS[1] = shard state (hash), e.g. tollgate:shard:{acme}
--           fields: ts (ms of the last reconcile), since (ms sharding began), seed (the
--           global bucket's fill when sharding began), s:<region> (share), d:<region>
--           (the region's last reported demand, requests/s), t:<region> (when it was
--           reported), f:<region> (last reported bucket fill)
-- KEYS[2] = history (list of JSON snapshots, newest first), e.g. tollgate:shardlog:{acme}
-- KEYS[3] = the client's global bucket, e.g. tollgate:b:{acme}
-- All three share the client's hash tag: one Redis Cluster slot.
--
-- ARGV[1] period (ms)      ARGV[2] this region       ARGV[3] its demand (requests/s,
-- measured over its own last interval, so reports need not line up with periods)
-- ARGV[4] its bucket fill (0..1, or '' if unknown)    ARGV[5] floor (share kept by idle
-- regions, summed over all regions)                   ARGV[6] capacity   ARGV[7] rate
-- ARGV[8] the field prefix of the shared bucket's state in KEYS[3] ('' or 'name:')
-- ARGV[9..] the client's regions
--
-- Returns { ts, since, seed, region1, share1, fill1, region2, ... } (numbers as strings).

local state, history, global = KEYS[1], KEYS[2], KEYS[3]
local period = tonumber(ARGV[1])
local me, demand, fill = ARGV[2], tonumber(ARGV[3]), ARGV[4]
local floor, cap, rate = tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])
local regions = {}
local field = ARGV[8]
for i = 9, #ARGV do regions[#regions + 1] = ARGV[i] end
local n = #regions

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

redis.call('HSET', state, 'd:' .. me, string.format('%.17g', demand), 't:' .. me, now)
if fill ~= '' then redis.call('HSET', state, 'f:' .. me, fill) end

local ts = tonumber(redis.call('HGET', state, 'ts') or '')
if not ts then
  -- Sharding begins: equal shares, and the regional buckets start as full as the global
  -- bucket is now, so the switch hands out no extra burst.
  local b = redis.call('HMGET', global, field .. 'tk', field .. 'ts')
  local seed = 1
  if b[1] then
    local elapsed = math.max(0, now * 1000 - tonumber(b[2]))
    seed = math.min(cap, tonumber(b[1]) + elapsed * rate / 1000000) / cap
  end
  redis.call('HSET', state, 'ts', now, 'since', now, 'seed', string.format('%.17g', seed))
  for _, r in ipairs(regions) do redis.call('HSET', state, 's:' .. r, string.format('%.17g', 1 / n)) end
elseif now - ts >= period then
  -- A region that stopped reporting (its gateways are gone) counts as idle.
  local d, total = {}, 0
  for i, r in ipairs(regions) do
    local at = tonumber(redis.call('HGET', state, 't:' .. r) or '0')
    d[i] = 0
    if now - at <= 3 * period then d[i] = tonumber(redis.call('HGET', state, 'd:' .. r) or '0') end
    total = total + d[i]
  end
  local shares = {}
  for i, r in ipairs(regions) do
    local s = 1 / n
    if total > 0 then s = floor / n + (1 - floor) * d[i] / total end
    shares[r] = s
    redis.call('HSET', state, 's:' .. r, string.format('%.17g', s))
  end
  redis.call('HSET', state, 'ts', now)
  local demands = {}
  for i, r in ipairs(regions) do demands[r] = d[i] end
  redis.call('LPUSH', history, cjson.encode({ at_ms = now, shares = shares, demand = demands }))
  redis.call('LTRIM', history, 0, 59)
end
-- A client no longer sharded (or idle) is forgotten after a day.
redis.call('PEXPIRE', state, 86400000)
redis.call('PEXPIRE', history, 86400000)

local out = { redis.call('HGET', state, 'ts'), redis.call('HGET', state, 'since'), redis.call('HGET', state, 'seed') }
for _, r in ipairs(regions) do
  out[#out + 1] = r
  out[#out + 1] = redis.call('HGET', state, 's:' .. r) or tostring(1 / n)
  out[#out + 1] = redis.call('HGET', state, 'f:' .. r) or ''
end
return out
