-- tollgate catalog apply of many changes, commit: the whole catalog the apply gives,
-- staged beside the live one by catalog_restore_stage.lua (under the apply's own id), put
-- in its place in one atomic step of a few key renames, only if the catalog is still at
-- the epoch and version the apply was computed against (the gateway checked the file
-- there: plans exist, every key has one owner, no plan in use is deleted). However many
-- records change, the commit costs the same: what grows with the catalog is staged before
-- it, a chunk a call. (catalog_apply.lua makes a few changes one by one instead, each with
-- its change-feed entry; past a hundred, that would hold Redis longer than a decision's
-- budget.) The records are staged at the versions the apply gives them (the catalog's
-- goes to ARGV[10]); the change feed is dropped, so every gateway reloads the catalog, as
-- after a restore. One audit entry ('catalog.apply') stands for the whole apply.
--
-- KEYS[1..9] plans, clients, keys, users, version, changes, settings, index, audit (as in
-- catalog_write.lua); KEYS[10] epoch; KEYS[11..16] the apply's staging plans, clients,
-- keys, users, index, settings; KEYS[17] the apply's reply (kept 10 minutes: a commit
-- resent after a lost reply answers it again and writes nothing).
--
-- ARGV[1] the epoch the apply was computed against ('' = none)   ARGV[2] its version
-- ARGV[3] how many plans were staged   ARGV[4] clients   ARGV[5] settings
-- ARGV[6] actor   ARGV[7] the apply's id   ARGV[8] an epoch for a catalog without one
-- ('' = leave it)   ARGV[9] the audit entry's summary (JSON)   ARGV[10] the version after
--
-- Returns { 'applied', version }, { 'moved', version } (nothing written), or
-- { 'incomplete', version } (the staging is not all there: it expired or the store lost
-- it; nothing written). A refusal deletes the staging.

local done = redis.call('GET', KEYS[17])
if done then return cjson.decode(done) end

local staging = { KEYS[11], KEYS[12], KEYS[13], KEYS[14], KEYS[15], KEYS[16] }
local epoch = redis.call('GET', KEYS[10]) or ''
local version = tonumber(redis.call('GET', KEYS[5]) or '0')
if epoch ~= ARGV[1] or version ~= tonumber(ARGV[2]) then
  redis.call('DEL', unpack(staging))
  return { 'moved', version }
end
if redis.call('HLEN', KEYS[11]) ~= tonumber(ARGV[3])
    or redis.call('HLEN', KEYS[12]) ~= tonumber(ARGV[4])
    or redis.call('HLEN', KEYS[16]) ~= tonumber(ARGV[5]) then
  redis.call('DEL', unpack(staging))
  return { 'incomplete', version }
end

-- Each live key is let go (UNLINK: freed off Redis' main thread, whatever its size) and
-- its staged key takes its name, kept for good; none staged: the catalog has none of it.
local live = { KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[8], KEYS[7] }
for n, key in ipairs(staging) do
  redis.call('UNLINK', live[n])
  if redis.call('EXISTS', key) == 1 then
    redis.call('RENAME', key, live[n])
    redis.call('PERSIST', live[n])
  end
end
redis.call('UNLINK', KEYS[6])
local v = tonumber(ARGV[10])
redis.call('SET', KEYS[5], v)
if ARGV[8] ~= '' then redis.call('SET', KEYS[10], ARGV[8], 'NX') end

local t = redis.call('TIME')
redis.call('XADD', KEYS[9], 'MAXLEN', '~', 100000, '*',
  'at_ms', tostring(tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)),
  'actor', ARGV[6], 'action', 'catalog.apply', 'kind', 'catalog', 'id', ARGV[7], 'rev', v,
  'before', cjson.encode({ version = version }), 'after', ARGV[9])
local reply = { 'applied', v }
redis.call('SET', KEYS[17], cjson.encode(reply), 'EX', 600)
return reply
