-- tollgate catalog restore: a gateway puts its in-memory copy of the catalog back into a
-- store whose catalog went back (Redis restarted empty, or from an older snapshot), as one
-- atomic step, only if the store is still exactly as the gateway saw it. So two gateways
-- restoring at once write one catalog, once: the second finds the store moved and takes
-- the store's view instead.
--
-- KEYS[1..9] plans, clients, keys, users, version, changes, settings, index, audit (as in
-- catalog_write.lua); KEYS[10] epoch (the catalog's identity).
--
-- ARGV[1] the epoch the gateway saw ('' = none)   ARGV[2] the version it saw
-- ARGV[3] the mirror's epoch ('' = none)          ARGV[4] the mirror's version
-- ARGV[5] the mirror: a JSON array of records, each
--   { kind = 'plan' | 'client' | 'setting', id, rev, json, plan?, hashes? }
--   where json is the record exactly as the gateway serialises it.
--
-- Returns 'restored', or 'moved' when the store is not as the gateway saw it.

local seen_epoch = redis.call('GET', KEYS[10]) or ''
local seen_version = tonumber(redis.call('GET', KEYS[5]) or '0')
if seen_epoch ~= ARGV[1] or seen_version ~= tonumber(ARGV[2]) then
  return 'moved'
end

-- What the store holds now is older than the mirror: replace it (the audit log stays).
redis.call('DEL', KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[6], KEYS[7], KEYS[8])
for _, r in ipairs(cjson.decode(ARGV[5])) do
  local value = r.rev .. ' ' .. r.json
  if r.kind == 'plan' then
    redis.call('HSET', KEYS[1], r.id, value)
  elseif r.kind == 'setting' then
    redis.call('HSET', KEYS[7], r.id, value)
  else
    redis.call('HSET', KEYS[2], r.id, value)
    redis.call('ZADD', KEYS[8], 0, r.id)
    redis.call('HINCRBY', KEYS[4], r.plan, 1)
    for _, h in ipairs(r.hashes) do redis.call('HSET', KEYS[3], h, r.id) end
  end
end
redis.call('SET', KEYS[5], ARGV[4])
if ARGV[3] == '' then
  redis.call('DEL', KEYS[10])
else
  redis.call('SET', KEYS[10], ARGV[3])
end
local t = redis.call('TIME')
redis.call('XADD', KEYS[9], 'MAXLEN', '~', 100000, '*',
  'at_ms', tostring(tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)),
  'actor', 'restore', 'action', 'catalog.restore', 'kind', 'catalog', 'id', ARGV[3],
  'rev', ARGV[4], 'before', cjson.encode({ epoch = ARGV[1], version = seen_version }),
  'after', cjson.encode({ epoch = ARGV[3], version = tonumber(ARGV[4]) }))
return 'restored'
