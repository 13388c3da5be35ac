-- tollgate catalog apply, commit: the writes staged by catalog_apply_stage.lua made in one
-- atomic step, only if the catalog is still at the epoch and version they were computed
-- against (the gateway checked them there: plans exist, every key has one owner, no plan
-- in use is deleted). Each write gets a version of its own and its change-feed entry, as
-- catalog_write.lua gives it, so gateways follow an apply as they follow single writes;
-- one audit entry ('catalog.apply') stands for all of them.
--
-- KEYS[1..9] plans, clients, keys, users, version, changes, settings, index, audit (as in
-- catalog_write.lua); KEYS[10] epoch; KEYS[11] the apply's staging list; KEYS[12] the
-- apply's reply (kept 10 minutes: a commit resent after a lost reply answers it again and
-- writes nothing); KEYS[13] the key filter, KEYS[14] its meta (key_filter.lua, before this).
--
-- ARGV[1] the epoch the writes were computed against ('' = none)   ARGV[2] its version
-- ARGV[3] how many writes were staged   ARGV[4] actor   ARGV[5] the apply's id
-- ARGV[6] an epoch for a catalog that has none yet   ARGV[7] the audit entry's summary
-- (JSON)
--
-- Returns { 'applied', version }, { 'moved', version } (nothing written), or
-- { 'incomplete', version } (the staging is not all there: it expired or the store lost
-- it; nothing written). A refusal deletes the staging.

local done = redis.call('GET', KEYS[12])
if done then return cjson.decode(done) end

local epoch = redis.call('GET', KEYS[10]) or ''
local version = tonumber(redis.call('GET', KEYS[5]) or '0')
if epoch ~= ARGV[1] or version ~= tonumber(ARGV[2]) then
  redis.call('DEL', KEYS[11])
  return { 'moved', version }
end
local staged = redis.call('LRANGE', KEYS[11], 0, -1)
if #staged ~= tonumber(ARGV[3]) then
  redis.call('DEL', KEYS[11])
  return { 'incomplete', version }
end
local writes = {}
for n, raw in ipairs(staged) do writes[n] = cjson.decode(raw) end

-- First every client written or deleted lets go of its keys and its plan, so a key that
-- moves between two clients of the apply is linked to its new owner whatever their order.
for _, w in ipairs(writes) do
  if w[1] == 'client' then
    local old = redis.call('HGET', KEYS[2], w[3])
    if old then
      local c = cjson.decode(string.sub(old, string.find(old, ' ', 1, true) + 1))
      for _, k in ipairs(c.keys or {}) do
        if redis.call('HGET', KEYS[3], k.hash) == w[3] then redis.call('HDEL', KEYS[3], k.hash) end
      end
      redis.call('HINCRBY', KEYS[4], c.plan, -1)
    end
  end
end

local v = version
for _, w in ipairs(writes) do
  local kind, op, id = w[1], w[2], w[3]
  local entities = KEYS[1]
  if kind == 'client' then entities = KEYS[2] elseif kind == 'setting' then entities = KEYS[7] end
  v = v + 1
  if op == 'delete' then
    redis.call('HDEL', entities, id)
    if kind == 'client' then redis.call('ZREM', KEYS[8], id) end
    redis.call('XADD', KEYS[6], 'MAXLEN', '~', 100000, v .. '-0', 'kind', kind, 'id', id)
  elseif kind == 'client' then
    local hashes = w[6]
    for _, h in ipairs(hashes) do
      redis.call('HSET', KEYS[3], h, id)
      filter_add(KEYS[13], KEYS[14], h)
    end
    redis.call('HINCRBY', KEYS[4], w[5], 1)
    redis.call('ZADD', KEYS[8], 0, id)
    redis.call('HSET', entities, id, v .. ' ' .. w[4])
    redis.call('XADD', KEYS[6], 'MAXLEN', '~', 100000, v .. '-0', 'kind', kind, 'id', id,
      'keys', table.concat(hashes, ','))
  else
    redis.call('HSET', entities, id, v .. ' ' .. w[4])
    redis.call('XADD', KEYS[6], 'MAXLEN', '~', 100000, v .. '-0', 'kind', kind, 'id', id)
  end
end
redis.call('SET', KEYS[5], v)
if ARGV[6] ~= '' then redis.call('SET', KEYS[10], ARGV[6], 'NX') end
redis.call('DEL', KEYS[11])

local t = redis.call('TIME')
redis.call('XADD', KEYS[9], 'MAXLEN', '~', 100000, '*',
  'at_ms', tostring(tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)),
  'actor', ARGV[4], 'action', 'catalog.apply', 'kind', 'catalog', 'id', ARGV[5], 'rev', v,
  'before', cjson.encode({ version = version }), 'after', ARGV[7])
local reply = { 'applied', v }
redis.call('SET', KEYS[12], cjson.encode(reply), 'EX', 600)
return reply
