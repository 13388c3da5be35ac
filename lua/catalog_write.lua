-- tollgate catalog write: one plan, client or setting put or deleted, atomically, with its
-- checks and its audit entry. A refusal writes nothing.
--
-- KEYS[1] plans    (hash: name -> "<rev> <json>")
-- KEYS[2] clients  (hash: id -> "<rev> <json>")
-- KEYS[3] keys     (hash: "sha256:<hex>" -> client id; no plaintext key is ever stored)
-- KEYS[4] users    (hash: plan name -> number of clients on it)
-- KEYS[5] version  (counter, bumped by every write)
-- KEYS[6] changes  (stream; entry id "<version>-0", fields kind, id, and a client put's
--                   key hashes as keys (comma-separated): the change feed)
-- KEYS[7] settings (hash: name -> "<rev> <json>", e.g. safety)
-- KEYS[8] index    (sorted set of client ids, for ordered pagination)
-- KEYS[9] audit    (stream: who changed what, when, before and after)
-- KEYS[10] this write's id (string, kept 10 minutes: the reply of a write that ran)
-- KEYS[11] epoch    (string: the catalog's identity, see catalog_restore.lua)
-- KEYS[12] the key filter, KEYS[13] its meta (see key_filter.lua, which comes before this)
-- All share the {catalog} hash tag, so this is one Redis Cluster slot.
--
-- A gateway that loses a reply with its connection resends the write on a fresh one
-- under the same id: if the first run happened, its reply is answered again and nothing
-- changes twice (no second version, no second audit entry, no 'stale' for a write that
-- succeeded).
--
-- ARGV[1] kind: 'plan' | 'client' | 'setting'   ARGV[2] op: 'put' | 'delete'
-- ARGV[3] id                                     ARGV[4] condition: 'any' | 'absent' | <rev>
-- ARGV[5] json (put)                             ARGV[6] the client's plan (client put)
-- ARGV[7] actor (JWT sub)                        ARGV[8] action (e.g. 'plan.put')
-- ARGV[9] an epoch for a catalog that has none yet ('' = leave it without: seeding the
--         configuration's records must not give a store that lost its catalog an
--         identity of its own, or the gateways could not restore it)
-- ARGV[10..] the client's key hashes (client put)
--
-- Returns { status, rev, detail }: 'ok' (rev = the new version, detail = the old json or
-- false), or a refusal: 'exists', 'stale' (rev = current), 'missing', 'unknown_plan',
-- 'plan_in_use', 'key_conflict'.

local done = redis.call('GET', KEYS[10])
if done then return cjson.decode(done) end

local kind, op, id, cond = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local entities = KEYS[1]
if kind == 'client' then entities = KEYS[2] elseif kind == 'setting' then entities = KEYS[7] end

local old = redis.call('HGET', entities, id)
local old_rev, old_json = 0, false
if old then
  local sp = string.find(old, ' ', 1, true)
  old_rev = tonumber(string.sub(old, 1, sp - 1))
  old_json = string.sub(old, sp + 1)
end

if cond == 'absent' then
  if old then return { 'exists', old_rev, old_json } end
elseif cond ~= 'any' then
  if not old then return { 'missing', 0, false } end
  if old_rev ~= tonumber(cond) then return { 'stale', old_rev, old_json } end
end

local function unlink_client(json)
  local c = cjson.decode(json)
  for _, k in ipairs(c.keys or {}) do redis.call('HDEL', KEYS[3], k.hash) end
  redis.call('HINCRBY', KEYS[4], c.plan, -1)
end

if op == 'delete' then
  if not old then return { 'missing', 0, false } end
  if kind == 'plan' then
    if tonumber(redis.call('HGET', KEYS[4], id) or '0') > 0 then
      return { 'plan_in_use', old_rev, old_json }
    end
  elseif kind == 'client' then
    unlink_client(old_json)
    redis.call('ZREM', KEYS[8], id)
  end
  redis.call('HDEL', entities, id)
elseif kind == 'client' then
  local plan = ARGV[6]
  if redis.call('HEXISTS', KEYS[1], plan) == 0 then return { 'unknown_plan', 0, plan } end
  for i = 10, #ARGV do
    local owner = redis.call('HGET', KEYS[3], ARGV[i])
    if owner and owner ~= id then return { 'key_conflict', 0, ARGV[i] } end
  end
  if old then unlink_client(old_json) end
  for i = 10, #ARGV do
    redis.call('HSET', KEYS[3], ARGV[i], id)
    filter_add(KEYS[12], KEYS[13], ARGV[i])
  end
  redis.call('HINCRBY', KEYS[4], plan, 1)
  redis.call('ZADD', KEYS[8], 0, id)
end

if ARGV[9] ~= '' then redis.call('SET', KEYS[11], ARGV[9], 'NX') end
local v = redis.call('INCR', KEYS[5])
local after = ''
if op ~= 'delete' then
  after = ARGV[5]
  redis.call('HSET', entities, id, v .. ' ' .. after)
end
if kind == 'client' and op == 'put' then
  -- The entry names the client's keys, so a gateway that caches clients forgets them as
  -- unknown without reading the record.
  local hashes = {}
  for i = 10, #ARGV do hashes[#hashes + 1] = ARGV[i] end
  redis.call('XADD', KEYS[6], 'MAXLEN', '~', 100000, v .. '-0', 'kind', kind, 'id', id,
    'keys', table.concat(hashes, ','))
else
  redis.call('XADD', KEYS[6], 'MAXLEN', '~', 100000, v .. '-0', 'kind', kind, 'id', id)
end
local t = redis.call('TIME')
redis.call('XADD', KEYS[9], 'MAXLEN', '~', 100000, '*',
  'at_ms', tostring(tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)),
  'actor', ARGV[7], 'action', ARGV[8], 'kind', kind, 'id', id, 'rev', v,
  'before', old_json or '', 'after', after)
redis.call('SET', KEYS[10], cjson.encode({ 'ok', v, old_json }), 'EX', 600)
return { 'ok', v, old_json }
