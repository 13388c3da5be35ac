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
-- Both share the client's hash tag: one Redis Cluster slot.
--
-- ARGV[1] period (ms)      ARGV[2] this region       ARGV[3] its demand (requests/s,
-- measured over its own last interval, so reports need not line up with periods)
-- ARGV[4] its bucket fill (0..1, or '' if unknown)    ARGV[5] floor (share kept by idle
-- regions, summed over all regions)
-- ARGV[6] the global bucket's fill now (0..1): the regional buckets start as full when
-- sharding begins (the caller reads it: the bucket's state lives in a group hash, in
-- another slot)
-- ARGV[7..] the client's regions
--
-- Returns { ts, since, seed, region1, share1, fill1, region2, ... } (numbers as strings).

local state, history = KEYS[1], KEYS[2]
local period = tonumber(ARGV[1])
local me, demand, fill = ARGV[2], tonumber(ARGV[3]), ARGV[4]
local floor, seed = tonumber(ARGV[5]), tonumber(ARGV[6])
local regions = {}
for i = 7, #ARGV do regions[#regions + 1] = ARGV[i] end
local n = #regions

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

redis.call('HSET', state, 'd:' .. me, string.format('%.17g', demand), 't:' .. me, now)
if fill ~= '' then redis.call('HSET', state, 'f:' .. me, fill) end

local ts = tonumber(redis.call('HGET', state, 'ts') or '')
if not ts then
  -- Sharding begins: equal shares, and the regional buckets start as full as the global
  -- bucket is now, so the switch hands out no extra burst.
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
