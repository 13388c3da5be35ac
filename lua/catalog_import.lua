-- tollgate catalog import: one chunk of a bulk import (`tollgate import`), all of its
-- clients created or none, and the import's progress recorded in the same step, so an
-- import stopped anywhere resumes at the first chunk not written.
--
-- KEYS[1] plans    KEYS[2] clients   KEYS[3] keys      KEYS[4] users
-- KEYS[5] version  KEYS[6] changes   KEYS[7] index     KEYS[8] audit
-- KEYS[9] epoch
-- KEYS[11] the key filter, KEYS[12] its meta (see key_filter.lua, which comes before this)
-- KEYS[10] this import's progress (hash: next = the next chunk to write, clients = how
--          many written, done = 1 once the last chunk is; kept 30 days)
-- All share the {catalog} hash tag, so this is one Redis Cluster slot.
--
-- ARGV[1] chunk number (0, 1, ...)   ARGV[2] '1' when it is the import's last chunk
-- ARGV[3] actor                      ARGV[4] the import's id (for the audit entry)
-- ARGV[5] an epoch for a catalog that has none yet
-- ARGV[6] the file's clients in all (for the audit entry)
-- then per client: id, plan, json, the number of keys n, then its n key hashes.
--
-- Returns { status, detail }: 'ok' (the catalog's version after it), 'done' (this chunk
-- was written already: detail = the next chunk), 'out_of_order' (detail = the next
-- chunk), or a refusal naming the client: 'exists', 'unknown_plan', 'key_conflict'
-- (detail = the id, or the key's hash). A refusal writes nothing.

local chunk = tonumber(ARGV[1])
local next_chunk = tonumber(redis.call('HGET', KEYS[10], 'next') or '0')
if chunk < next_chunk then return { 'done', tostring(next_chunk) } end
if chunk > next_chunk then return { 'out_of_order', tostring(next_chunk) } end

-- Read the clients, and check all of them before writing any.
local clients = {}
local i = 7
local seen_keys = {}
while i <= #ARGV do
  local c = { id = ARGV[i], plan = ARGV[i + 1], json = ARGV[i + 2], hashes = {} }
  local n = tonumber(ARGV[i + 3])
  for j = 1, n do c.hashes[j] = ARGV[i + 3 + j] end
  i = i + 4 + n
  if redis.call('HEXISTS', KEYS[2], c.id) == 1 then return { 'exists', c.id } end
  if redis.call('HEXISTS', KEYS[1], c.plan) == 0 then return { 'unknown_plan', c.id } end
  for _, h in ipairs(c.hashes) do
    if seen_keys[h] or redis.call('HEXISTS', KEYS[3], h) == 1 then
      return { 'key_conflict', h }
    end
    seen_keys[h] = true
  end
  clients[#clients + 1] = c
end

-- Each client is one version and one change-feed entry, as a write through the admin API
-- (gateways follow them alike); the entry names its keys, so a gateway that caches
-- clients forgets them as unknown without reading the record.
local v = 0
for _, c in ipairs(clients) do
  v = redis.call('INCR', KEYS[5])
  redis.call('HSET', KEYS[2], c.id, v .. ' ' .. c.json)
  for _, h in ipairs(c.hashes) do
    redis.call('HSET', KEYS[3], h, c.id)
    filter_add(KEYS[11], KEYS[12], h)
  end
  redis.call('HINCRBY', KEYS[4], c.plan, 1)
  redis.call('ZADD', KEYS[7], 0, c.id)
  redis.call('XADD', KEYS[6], 'MAXLEN', '~', 100000, v .. '-0', 'kind', 'client', 'id', c.id,
    'keys', table.concat(c.hashes, ','))
end
if ARGV[5] ~= '' then redis.call('SET', KEYS[9], ARGV[5], 'NX') end
local written = redis.call('HINCRBY', KEYS[10], 'clients', #clients)
redis.call('HSET', KEYS[10], 'next', chunk + 1)
if ARGV[2] == '1' then
  -- The import's one audit entry, with the last chunk.
  redis.call('HSET', KEYS[10], 'done', 1)
  local t = redis.call('TIME')
  redis.call('XADD', KEYS[8], 'MAXLEN', '~', 100000, '*',
    'at_ms', tostring(tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)),
    'actor', ARGV[3], 'action', 'catalog.import', 'kind', 'catalog', 'id', ARGV[4],
    'rev', tostring(redis.call('GET', KEYS[5]) or '0'), 'before', '',
    'after', cjson.encode({ clients = written, chunks = chunk + 1, in_file = tonumber(ARGV[6]) }))
end
redis.call('EXPIRE', KEYS[10], 2592000)
return { 'ok', tostring(redis.call('GET', KEYS[5]) or '0') }
