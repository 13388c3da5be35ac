-- tollgate catalog restore, commit: a gateway puts its copy of the catalog, staged in
-- chunks by catalog_restore_stage.lua, in place of a store whose catalog went back (Redis
-- restarted empty, or from an older snapshot), as one atomic step, only if the store is
-- still exactly as the gateway saw it. So two gateways restoring at once write one
-- catalog, once: the second finds the store moved and takes the store's view instead.
--
-- KEYS[1..9] plans, clients, keys, users, version, changes, settings, index, audit (as in
-- catalog_write.lua); KEYS[10] epoch (the catalog's identity);
-- KEYS[11..16] the restore's staging plans, clients, keys, users, index, settings;
-- KEYS[17] the key filter, KEYS[18] its meta (see key_filter.lua): deleted, since the keys
-- change whole; gateways build it again.
--
-- ARGV[1] the epoch the gateway saw ('' = none)   ARGV[2] the version it saw
-- ARGV[3] the mirror's epoch ('' = none)          ARGV[4] the mirror's version
-- ARGV[5] how many plans it staged   ARGV[6] clients   ARGV[7] settings
--
-- Returns 'restored'; 'moved' when the store is not as the gateway saw it (a commit
-- resent after a lost reply finds it so: it ran); 'incomplete' when the staging is not
-- all there (it expired, or the store lost it). Either refusal changes nothing live and
-- deletes the staging.

local staging = { KEYS[11], KEYS[12], KEYS[13], KEYS[14], KEYS[15], KEYS[16] }

local seen_epoch = redis.call('GET', KEYS[10]) or ''
local seen_version = tonumber(redis.call('GET', KEYS[5]) or '0')
if seen_epoch ~= ARGV[1] or seen_version ~= tonumber(ARGV[2]) then
  redis.call('DEL', unpack(staging))
  return 'moved'
end
if redis.call('HLEN', KEYS[11]) ~= tonumber(ARGV[5])
    or redis.call('HLEN', KEYS[12]) ~= tonumber(ARGV[6])
    or redis.call('HLEN', KEYS[16]) ~= tonumber(ARGV[7]) then
  redis.call('DEL', unpack(staging))
  return 'incomplete'
end

-- What the store holds now is older than the mirror: each staged key replaces its live
-- key (none staged: the mirror has none of it), kept for good. The audit log stays.
local live = { KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[8], KEYS[7] }
for n, key in ipairs(staging) do
  if redis.call('EXISTS', key) == 1 then
    redis.call('RENAME', key, live[n])
    redis.call('PERSIST', live[n])
  else
    redis.call('DEL', live[n])
  end
end
redis.call('DEL', KEYS[6], KEYS[17], KEYS[18])
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
