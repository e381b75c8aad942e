"""The admission queue's Lua: every operation is one atomic script over one pool's keys.

Layout (prefix ``tq:{pool}:``, one hash tag, so one Redis Cluster slot; KEYS[1] is the pool's
``meta`` key, which routes the call to that slot, and every other key is derived from it)::

    r:<m>          HASH  a request (m = "T:<request id>~<nonce>": one admission call's own entry, named by
                         the router's nonce): st (q queued | l leased | x lease expired | s settled | d dropped:
                         the last three are tombstones that expire), t tenant, c class,
                         cost (estimated tokens), S virtual start tag, seq, dl deadline ms (0 = none),
                         lg the latest grant that leaves it time to be served (0 = none),
                         o owner router, n the owner's nonce, f fence, tg granted at
    q:<c>:<T>      ZSET  tenant T's queued requests of class c, by arrival seq (FIFO)
    cq:<c>         ZSET  every queued request of class c, by seq (its depth; positions)
    ready:<c>      ZSET  tenants with a request of class c that may be dispatched, by head's S
    qexp           ZSET  queued requests by min(latest useful grant, owner keep-alive)
    leases         ZSET  every lease, by expiry (ZCARD = the pool's in-flight count)
    tl:<T>         ZSET  tenant T's leases, by expiry (ZCARD = its in-flight count)
    tc:<T>         HASH  tenant T's limits as its routers last sent them: mi mq tpm w
    park           ZSET  tenants waiting for their token budget, by when it allows their head
    tat:<T>        STR   tenant T's GCRA theoretical arrival time (ms), tokens per minute
    fin:<c>        HASH  tenant -> virtual finish tag in class c;  vt:<c> STR the class's virtual time
    srv            HASH  per class c: c (tokens granted to c from its queue) and w:c (tokens granted
                         to any class while c was queued), decayed (half-life 10 s); ts = last decay
    hold           ZSET  held slots "T:tag" by expiry (they count as taken); hd:<T> ZSET the
                         tenant's; T = "#<class>" for a slot held for a class (priority hold)
    qts:<c>        STR   when a request of class c last had to queue or took a slot held for c (ms)
    qcost          HASH  tenant -> estimated tokens queued
    stats          HASH  svc (EWMA lease seconds x1000), dev (EWMA of its absolute deviation, ms), n (samples)
    cap            STR   the pool's capacity in requests, as the last caller saw its engines
    seq, fence     STR   counters
    g:<router>     pub/sub channel: grants and removals for the requests a router holds

Fair queuing is start-time fair queuing over estimated tokens (prompt + max_tokens) per class:
a request of tenant T gets S = max(V, F_T), F_T = S + cost / weight; the ready tenant with the
lowest head S is served and V becomes that S. An idle tenant's F_T falls behind V, so it banks
no credit; settling a request corrects F_T (and the token budget) by actual - estimated tokens.
Between classes: strict priority, except that a backlogged class below its minimum share goes
first. Its share is its tokens granted from the queue over the tokens granted (to any class) while
it waited (w:c): it banks no deficit from before it asked, and no surplus from what it took at once
while the pool had room. The minimum share is a floor; the priority hold keeps a lower class near
it (not at a multiple of it) while a higher class wants every slot. With a hold time (ARGV[2]'s
HOLD), a slot a SETTLE frees that its tenant does not keep (the slot hold: below its fair share,
or above every queued class) and that the dispatch would give to a class below H is held for class
H instead, where H is the highest class that had to queue (or took a slot held for it) within the
last max(2 x mean lease, 10 x HOLD) ms and has nothing queued now (its clients are between
requests), while every queued lower class has MARGIN (1.2) x its minimum share or more. Any tenant
of H takes it on ENQUEUE's fast path; one of H that must queue anyway hands it back to the
dispatch; unused, it expires after HOLD and goes to the queue. No hold of either kind is given
while a queued lower class is under MARGIN x its minimum share. Without the priority hold the
work-conserving dispatch gave a batch class every slot that freed while the interactive clients
were between requests, each for a whole lease.
A lease counts until settled or expired; any script reaps what expired before it acts, then
dispatches while the pool has room.

ARGV of every script: [1] classes "name,min_share,max_queued;..." highest priority first,
[2] the caller's view of the pool capacity ("" = the stored one), [3] the caller's router id,
[4] lease / keep-alive TTL in ms; the operation's own arguments follow.
Replies never carry floats (Redis truncates them); times are integer milliseconds.

Each script starts with a Redis 7 shebang: ENQUEUE is refused before it runs when Redis is at
maxmemory (a clean OutOfMemoryError, nothing half-written); the others carry `allow-oom`, since
settling, cancelling and expiring free memory and must go on.

The same operations also make one Redis function library (`LIBRARY`, `FUNCTIONS`: what the routers
call by default, `--queue-code library`): the same Lua, its shared functions defined once when the
library loads instead of on every call, the same flags per function (docs/admission.md).
"""

import hashlib

# Every call's own state: the pool's key prefix, the time, the class table, the caller, the capacity,
# and the grants and freed slots the call collects. In the scripts (EVALSHA) these are locals of the
# call; in the function library (`LIBRARY`) they live beside its functions and `setup` sets them on
# each call, the class table parsed again only when ARGV[1] changed.
_STATE_NAMES = "P, NOW, CLASSES, SHARE, CMAXQ, RANK, CLASSES_ARG, ME, TTL, CAP, HEADROOM, HOLD, GRANTS, FREED"
_STATE = r"""
P = string.sub(KEYS[1], 1, -5)
local tm = redis.call('TIME')
NOW = tonumber(tm[1]) * 1000 + math.floor(tonumber(tm[2]) / 1000)
if ARGV[1] ~= CLASSES_ARG then
  CLASSES, SHARE, CMAXQ, RANK = {}, {}, {}, {}
  for name, share, maxq in string.gmatch(ARGV[1], '([^,;]+),([^,;]+),([^,;]+)') do
    CLASSES[#CLASSES + 1] = name
    SHARE[name] = tonumber(share)
    CMAXQ[name] = tonumber(maxq)
    RANK[name] = #CLASSES
  end
  CLASSES_ARG = ARGV[1]
end
ME, TTL = ARGV[3], tonumber(ARGV[4])
-- ARGV[2] = "CAP:HEADROOM": requests dispatched freely, and the slots beyond them that only a tenant
-- below its fair share of the whole pool may take (so a quiet tenant never waits behind a noisy one's
-- full pool for a slot to free).
-- A third field, HOLD (ms), keeps the slot a tenant below its share just freed for its next request
-- that long (it is between requests; without the hold the busiest tenant takes the slot at once).
CAP, HEADROOM, HOLD = 1000000000, 0, 0           -- never told: no bound of its own
local cap_spec = ARGV[2]
if cap_spec == '' then cap_spec = redis.call('GET', P .. 'cap') or '' end
if cap_spec ~= '' then
  local a, b, h = string.match(cap_spec, '^(%d+):?(%d*):?(%d*)$')
  CAP, HEADROOM, HOLD = tonumber(a), tonumber(b) or 0, tonumber(h) or 0
end
GRANTS = {}      -- {member, fence} of grants owned by the caller (others get a PUBLISH)
-- Fences of the leases this call ended whose tenant keeps no slot (SETTLE fills it): each such slot
-- the dispatch would give to a class below the priority hold's class is held for that class instead.
FREED = {}
"""

# The helper functions every operation shares (defined on every EVALSHA call; once in `LIBRARY`).
_FUNCTIONS = r"""
local function store_cap()        -- by the periodic calls (BEAT, REAP): the reaper's dispatch uses it
  if ARGV[2] ~= '' then redis.call('SET', P .. 'cap', ARGV[2]) end
end

local function rk(m) return P .. 'r:' .. m end
local function tenant_of(m) return string.match(m, '^([^:]*):') end

local function notify(owner, m, fence, why)
  if owner == ME then
    GRANTS[#GRANTS + 1] = m
    GRANTS[#GRANTS + 1] = fence
    GRANTS[#GRANTS + 1] = why
  elseif owner then
    redis.call('PUBLISH', P .. 'g:' .. owner, m .. '\n' .. fence .. '\n' .. why)
  end
end

local function head(c, T)
  local h = redis.call('ZRANGE', P .. 'q:' .. c .. ':' .. T, 0, 0)
  if #h == 0 then return nil, nil end
  return tonumber(redis.call('HGET', rk(h[1]), 'S')), h[1]
end

local function vtime(c) return tonumber(redis.call('GET', P .. 'vt:' .. c) or '0') end

-- T's place among class c's ready tenants: its head's start tag, but never below the class's
-- virtual time, so a tenant held back by its own limits (in flight, token budget) banks no credit.
local function refresh(c, T)
  local s = head(c, T)
  if s and not redis.call('ZSCORE', P .. 'park', T) then
    redis.call('ZADD', P .. 'ready:' .. c, math.max(s, vtime(c)), T)
  else
    redis.call('ZREM', P .. 'ready:' .. c, T)
  end
end

local function readd(T)
  for _, c in ipairs(CLASSES) do refresh(c, T) end
end

local function unready(T)
  for _, c in ipairs(CLASSES) do redis.call('ZREM', P .. 'ready:' .. c, T) end
end

local function tenant_queued(T)
  local n = 0
  for _, c in ipairs(CLASSES) do n = n + redis.call('ZCARD', P .. 'q:' .. c .. ':' .. T) end
  return n
end

local function position(m, c)
  local n = redis.call('ZRANK', P .. 'cq:' .. c, m)
  if not n then return 0 end
  for _, cc in ipairs(CLASSES) do
    if RANK[cc] < RANK[c] then n = n + redis.call('ZCARD', P .. 'cq:' .. cc) end
  end
  return n + 1
end

local function ahead(c)           -- queued requests of class c and above, and of class c alone
  local n, own = 0, 0
  for _, cc in ipairs(CLASSES) do
    if RANK[cc] <= RANK[c] then
      local k = redis.call('ZCARD', P .. 'cq:' .. cc)
      n = n + k
      if cc == c then own = k end
    end
  end
  return n, own
end

local function mean_lease()       -- ms a lease lasts on average, -1 = fewer than 10 seen yet
  local st = redis.call('HMGET', P .. 'stats', 'svc', 'n')
  if not st[2] or tonumber(st[2]) < 10 then return -1 end
  return tonumber(st[1])
end

-- ms to set aside from a deadline for a request to be served: a long lease (the mean plus twice its
-- mean absolute deviation, ~p95 of a normal spread), -1 = fewer than 10 seen yet. The mean alone
-- left a request granted at the end of its wait a coin's chance of finishing (scenario d: 3-5% of
-- the pool's tokens went to streams cut off by their deadline).
local function set_aside()
  local svc = mean_lease()
  if svc < 0 then return -1 end
  return svc + 2 * tonumber(redis.call('HGET', P .. 'stats', 'dev') or '0')
end

local function est_wait(n)        -- ms for n requests ahead to be served, -1 = no estimate yet
  local svc = mean_lease()
  if svc < 0 or CAP <= 0 then return -1 end
  return math.floor(n * svc / CAP)
end

-- The minimum share is measured over the recently granted tokens (decayed, half-life 10 s): per class
-- c its tokens granted from the queue (srv c) against the tokens of every class granted while c was
-- waiting (srv w:c). So a class banks no deficit (what others got before it asked does not count)
-- and no surplus (what it took at once while the pool had room does not count either).
local MARGIN = 1.2     -- the holds stop when a queued lower class falls under MARGIN x its share
local function decay()
  local ts = tonumber(redis.call('HGET', P .. 'srv', 'ts') or NOW)
  local f = 0.5 ^ ((NOW - ts) / 10000)
  local vals, base = {}, {}
  for _, c in ipairs(CLASSES) do
    local v = redis.call('HMGET', P .. 'srv', c, 'w:' .. c)
    vals[c], base[c] = tonumber(v[1] or '0') * f, tonumber(v[2] or '0') * f
    redis.call('HSET', P .. 'srv', c, vals[c], 'w:' .. c, base[c])
  end
  redis.call('HSET', P .. 'srv', 'ts', NOW)
  return vals, base
end

local function below_share(c, served, base, margin)     -- (a class never served yet is below)
  return SHARE[c] > 0 and (served[c] <= 0 or served[c] < SHARE[c] * (margin or 1) * base[c])
end

-- tokens granted (or corrected) in class c; queued: granted from the queue (not on the fast path)
local function credit(c, tokens, queued)
  if queued then
    local v = tonumber(redis.call('HGET', P .. 'srv', c) or '0') + tokens
    redis.call('HSET', P .. 'srv', c, math.max(v, 0))
  end
  for _, cc in ipairs(CLASSES) do
    if SHARE[cc] > 0 and ((cc == c and queued) or (cc ~= c and redis.call('ZCARD', P .. 'cq:' .. cc) > 0)) then
      local b = tonumber(redis.call('HGET', P .. 'srv', 'w:' .. cc) or '0') + tokens
      redis.call('HSET', P .. 'srv', 'w:' .. cc, math.max(b, 0))
    end
  end
end

local function limits(T)
  local cfg = redis.call('HMGET', P .. 'tc:' .. T, 'mi', 'mq', 'tpm', 'w')
  return tonumber(cfg[1] or '1000000000'), tonumber(cfg[2] or '0'), tonumber(cfg[3] or '0'),
         tonumber(cfg[4] or '1')
end

-- GCRA over tokens: ms until `cost` more tokens fit the tenant's per-minute budget, and the new TAT.
local function rate_wait(T, tpm, cost)
  if tpm <= 0 then return 0, 0 end
  local tat = tonumber(redis.call('GET', P .. 'tat:' .. T) or '0')
  local new = math.max(tat, NOW) + cost * 60000 / tpm
  return math.max(0, new - 60000 - NOW), new
end

local function charge(T, tpm, tokens)   -- correct the budget by tokens (may be negative)
  if tpm <= 0 or tokens == 0 then return end
  local key = P .. 'tat:' .. T
  local tat = redis.call('GET', key)
  if tat then redis.call('SET', key, tonumber(tat) + tokens * 60000 / tpm, 'PX', 120000) end
end

local function unqueue(m, c, T)
  redis.call('ZREM', P .. 'q:' .. c .. ':' .. T, m)
  redis.call('ZREM', P .. 'cq:' .. c, m)
  redis.call('ZREM', P .. 'qexp', m)
  refresh(c, T)
end

-- A lease taken / given back; `act` holds the weights of the tenants that hold leases (for the
-- fair share of the headroom).
local function add_lease(m, T, w)
  redis.call('ZADD', P .. 'leases', NOW + TTL, m)
  redis.call('ZADD', P .. 'tl:' .. T, NOW + TTL, m)
  redis.call('HSET', P .. 'act', T, w)
end

local function drop_lease(m, T)
  redis.call('ZREM', P .. 'leases', m)
  redis.call('ZREM', P .. 'tl:' .. T, m)
  if redis.call('ZCARD', P .. 'tl:' .. T) == 0 then redis.call('HDEL', P .. 'act', T) end
end

-- May T take a slot of the headroom? Only while it holds less than its weight's share of the freely
-- dispatched slots, among the tenants holding leases and itself: a tenant alone never reaches the
-- headroom (it holds all of CAP), a newcomer beside a noisy one does at once.
local function under_share(T, w)
  local total = w
  if redis.call('HEXISTS', P .. 'act', T) == 1 then total = 0 end
  for _, v in ipairs(redis.call('HVALS', P .. 'act')) do total = total + tonumber(v) end
  return redis.call('ZCARD', P .. 'tl:' .. T) < CAP * w / total
end

-- Held slots (`hold` ZSET, and per tenant `hd:<T>`, members "T:tag" by expiry) count as taken.
local function expire_holds()
  for _, h in ipairs(redis.call('ZRANGEBYSCORE', P .. 'hold', '-inf', NOW, 'LIMIT', 0, 64)) do
    redis.call('ZREM', P .. 'hold', h)
    redis.call('ZREM', P .. 'hd:' .. tenant_of(h), h)
  end
end

local function busy()
  return redis.call('ZCARD', P .. 'leases') + redis.call('ZCARD', P .. 'hold')
end

local function take_hold(T)       -- use one of T's held slots; false if it holds none
  local h = redis.call('ZRANGE', P .. 'hd:' .. T, 0, 0)[1]
  if not h then return false end
  redis.call('ZREM', P .. 'hd:' .. T, h)
  redis.call('ZREM', P .. 'hold', h)
  return true
end

local function give_hold(T, tag)
  local h = T .. ':' .. tag
  redis.call('ZADD', P .. 'hold', NOW + HOLD, h)
  redis.call('ZADD', P .. 'hd:' .. T, NOW + HOLD, h)
  redis.call('PEXPIRE', P .. 'hd:' .. T, HOLD * 4 + 1000)
end

local function depths(out)        -- queued requests per class, appended to a reply
  for _, c in ipairs(CLASSES) do out[#out + 1] = redis.call('ZCARD', P .. 'cq:' .. c) end
  return out
end

local function someone_queued()
  for _, c in ipairs(CLASSES) do
    if redis.call('ZCARD', P .. 'cq:' .. c) > 0 then return true end
  end
  return false
end

-- Only call it right before granting T a request of class c: it may use up one of T's held slots,
-- or one held for its class (then c counts as having queued: it took a slot beyond those it held).
local function room_for(T, w, c)
  if HOLD > 0 then
    if take_hold(T) then return true end
    if take_hold('#' .. c) then
      redis.call('SET', P .. 'qts:' .. c, NOW, 'PX', 600000)
      return true
    end
  end
  local inflight = busy()
  if inflight < CAP then return true end
  return HEADROOM > 0 and inflight < CAP + HEADROOM and under_share(T, w)
end

local function grant(m, c, T, s)
  local rec = redis.call('HMGET', rk(m), 'cost', 'o')
  local cost = tonumber(rec[1])
  unqueue(m, c, T)
  local fence = redis.call('INCR', P .. 'fence')
  redis.call('HSET', rk(m), 'st', 'l', 'f', fence, 'tg', NOW)
  local _, _, _, w = limits(T)
  add_lease(m, T, w)
  redis.call('SET', P .. 'vt:' .. c, math.max(vtime(c), s))
  redis.call('HINCRBY', P .. 'qcost', T, -cost)
  credit(c, cost, true)
  notify(rec[2], m, fence, 'grant')
end

local function choose()
  local backlog = {}
  for _, c in ipairs(CLASSES) do
    if redis.call('ZCARD', P .. 'ready:' .. c) > 0 then backlog[#backlog + 1] = c end
  end
  if #backlog <= 1 then return backlog[1] end
  local served, base = decay()
  for i = #backlog, 2, -1 do     -- the lowest class first: one below its minimum share goes first
    local c = backlog[i]
    if below_share(c, served, base) then return c end
  end
  return backlog[1]
end

-- The next (class, tenant, start tag) to serve: by class policy and fair tags while the pool has
-- room; in the headroom, the first ready tenant below its share, classes in priority order.
local function pick(inflight)
  if inflight < CAP then
    local c = choose()
    if not c then return nil end
    local top = redis.call('ZRANGE', P .. 'ready:' .. c, 0, 0, 'WITHSCORES')
    return c, top[1], tonumber(top[2])
  end
  for _, c in ipairs(CLASSES) do
    local top = redis.call('ZRANGE', P .. 'ready:' .. c, 0, 15, 'WITHSCORES')
    for i = 1, #top, 2 do
      local _, _, _, w = limits(top[i])
      if under_share(top[i], w) then return c, top[i], tonumber(top[i + 1]) end
    end
  end
  return nil
end

-- Every one of these (queued) classes has its minimum share of the recently granted tokens and a
-- fifth more (a margin: the holds stop before the class falls to its floor, which the dispatch keeps).
local function at_share(lower)
  local served, base = decay()
  for _, cc in ipairs(lower) do
    if below_share(cc, served, base, MARGIN) then return false end
  end
  return true
end

-- The priority hold: the class a freed slot is held for (any tenant of it may take it), or nil. It
-- is the highest class that had to queue (or took a slot held for it) within the last two mean
-- leases, at least ten hold times (it wants more slots than it holds), with nothing of it queued
-- now (its clients are between requests), when a lower class is queued and every queued lower class
-- has MARGIN x its minimum share. Without it the slot goes to the lower class for a whole lease
-- whenever the higher one is between requests.
local function priority_hold()
  local window = math.max(2 * tonumber(redis.call('HGET', P .. 'stats', 'svc') or '0'), 10 * HOLD)
  local H, lower = nil, {}
  for _, c in ipairs(CLASSES) do
    if redis.call('ZCARD', P .. 'cq:' .. c) > 0 then
      if not H then return nil end          -- the dispatch serves this class anyway
      lower[#lower + 1] = c
    elseif not H and tonumber(redis.call('GET', P .. 'qts:' .. c) or '-1') >= NOW - window then
      H = c
    end
  end
  if H and #lower > 0 and at_share(lower) then return H end
  return nil
end

-- An ended request's record stays a while as a tombstone (d dropped, s settled), so that a
-- heartbeat already on its way with it never mistakes it for one Redis lost and restores it.
local function tombstone(m, st)
  redis.call('DEL', rk(m))
  redis.call('HSET', rk(m), 'st', st)
  redis.call('PEXPIRE', rk(m), TTL * 2)
end

local function drop_queued(m, why)
  local rec = redis.call('HMGET', rk(m), 'c', 'o', 'cost')
  local T = tenant_of(m)
  if rec[1] then
    unqueue(m, rec[1], T)
    redis.call('HINCRBY', P .. 'qcost', T, -tonumber(rec[3]))
    notify(rec[2], m, -1, why)
  else
    redis.call('ZREM', P .. 'qexp', m)
  end
  tombstone(m, 'd')
  -- why, for a heartbeat that still lists it before the message reached its router (it would
  -- otherwise be told 'lost', and its client UNAVAILABLE instead of, say, DEADLINE_EXCEEDED)
  redis.call('HSET', rk(m), 'why', why)
end


local function dispatch()
  local inflight = busy()
  local guard = 0
  while inflight < CAP + HEADROOM and guard < 256 do
    guard = guard + 1
    local c, T, s = pick(inflight)
    if not c then break end
    local H = nil
    if #FREED > 0 and HOLD > 0 and inflight < CAP then H = priority_hold() end
    local _, m = head(c, T)
    if H and RANK[H] < RANK[c] then
      give_hold('#' .. H, table.remove(FREED))
      inflight = inflight + 1
    elseif not m then
      redis.call('ZREM', P .. 'ready:' .. c, T)
    else
      local mi, _, tpm = limits(T)
      local rec = redis.call('HMGET', rk(m), 'lg', 'cost')
      local lg = tonumber(rec[1] or '0')
      if lg > 0 and lg < NOW then
        -- its turn came too late to serve it before its deadline: granted, it would hold a slot
        -- only to be cut off mid-stream, its tokens wasted; it leaves the queue now instead
        drop_queued(m, 'late')
      elseif redis.call('ZCARD', P .. 'tl:' .. T) >= mi then
        unready(T)                -- back when one of its leases ends
      else
        local wait, new = rate_wait(T, tpm, tonumber(rec[2]))
        if wait > 0 then
          redis.call('ZADD', P .. 'park', NOW + wait, T)
          unready(T)
        else
          if tpm > 0 then redis.call('SET', P .. 'tat:' .. T, new, 'PX', 120000) end
          grant(m, c, T, s)
          inflight = inflight + 1
        end
      end
    end
  end
end

local function end_lease(m, T)
  drop_lease(m, T)
  if tenant_queued(T) > 0 then readd(T) end   -- it may have been held back by its max_in_flight
end

local function housekeeping()
  expire_holds()
  for _, m in ipairs(redis.call('ZRANGEBYSCORE', P .. 'leases', '-inf', NOW, 'LIMIT', 0, 128)) do
    end_lease(m, tenant_of(m))   -- its owner stopped heartbeating: the capacity returns
    if redis.call('EXISTS', rk(m)) == 1 then
      redis.call('HSET', rk(m), 'st', 'x')
      redis.call('PEXPIRE', rk(m), TTL * 4)
    end
  end
  for _, m in ipairs(redis.call('ZRANGEBYSCORE', P .. 'qexp', '-inf', NOW, 'LIMIT', 0, 128)) do
    local t = redis.call('HMGET', rk(m), 'dl', 'lg')
    local dl, lg = tonumber(t[1] or '0'), tonumber(t[2] or '0')
    if dl > 0 and dl <= NOW then drop_queued(m, 'deadline')
    elseif lg > 0 and lg <= NOW then drop_queued(m, 'late')
    else drop_queued(m, 'lost') end
  end
  for _, T in ipairs(redis.call('ZRANGEBYSCORE', P .. 'park', '-inf', NOW, 'LIMIT', 0, 128)) do
    redis.call('ZREM', P .. 'park', T)
    readd(T)
  end
end

-- The latest a request with deadline dl may be granted and still be served: a long lease before
-- it, at most half the time it has left now (ENQUEUE's wait limit, as a time); 0 = none.
local function latest_grant(dl)
  if dl <= 0 then return 0 end
  return dl - math.min(math.max(set_aside(), 0), math.max(dl - NOW, 0) / 2)
end

-- Queue request m (the caller checked it is new). Its keep-alive runs from now. lg: its latest useful
-- grant when the caller has it already (ENQUEUE), else read here (`latest_grant`).
local function insert(m, T, c, cost, dl, owner, nonce, w, lg)
  local seq = redis.call('INCR', P .. 'seq')
  local s = math.max(vtime(c), tonumber(redis.call('HGET', P .. 'fin:' .. c, T) or '0'))
  lg = lg or latest_grant(dl)
  redis.call('HSET', P .. 'fin:' .. c, T, s + cost / w)
  redis.call('HSET', rk(m), 'st', 'q', 't', T, 'c', c, 'cost', cost, 'S', s, 'seq', seq, 'dl', dl,
             'lg', lg, 'o', owner, 'n', nonce, 'f', 0, 'tg', 0)
  redis.call('PERSIST', rk(m))
  redis.call('ZADD', P .. 'q:' .. c .. ':' .. T, seq, m)
  redis.call('ZADD', P .. 'cq:' .. c, seq, m)
  redis.call('SET', P .. 'qts:' .. c, NOW, 'PX', 600000)
  local exp = NOW + TTL
  if lg > 0 and lg < exp then exp = lg end
  redis.call('ZADD', P .. 'qexp', exp, m)
  redis.call('HINCRBY', P .. 'qcost', T, cost)
  refresh(c, T)
end

local function set_limits(T, mi, mq, tpm, w)
  redis.call('HSET', P .. 'tc:' .. T, 'mi', mi, 'mq', mq, 'tpm', tpm, 'w', w)
end

-- Grant m at once, without queueing it (nothing queued ahead, room in the pool): the same tags and
-- accounting as a dispatch from the queue, in a dozen commands instead of some sixty.
local function grant_now(m, T, c, cost, dl, nonce, w)
  local s = math.max(vtime(c), tonumber(redis.call('HGET', P .. 'fin:' .. c, T) or '0'))
  redis.call('HSET', P .. 'fin:' .. c, T, s + cost / w)
  redis.call('SET', P .. 'vt:' .. c, s)
  local fence = redis.call('INCR', P .. 'fence')
  redis.call('DEL', rk(m))
  redis.call('HSET', rk(m), 'st', 'l', 't', T, 'c', c, 'cost', cost, 'S', s, 'seq', 0, 'dl', dl,
             'o', ME, 'n', nonce, 'f', fence, 'tg', NOW)
  add_lease(m, T, w)
  credit(c, cost, false)
  return fence
end
"""

PRELUDE = f"local {_STATE_NAMES}\n" + _STATE + _FUNCTIONS

# Many requests in one call (the router batches those that arrive together): ARGV[5] = n, then
# per request 10 values: member, class, cost, deadline_ms (remaining; 0 = none), nonce,
# max_in_flight, max_queued, tokens_per_minute, weight, max_wait_ms.
# Reply: per request a triple {1, fence, 0} granted | {2, position, est_wait_ms} queued (the
# position as '<position>/full' when the tenant's queue is full with it) |
# {0, reason, retry_after_ms} refused (TOKEN_RATE_LIMITED as 'TOKEN_RATE_LIMITED/<long lease ms it set
# aside>'); then the grants (member, fence, why) of other requests.
# An entry of the same id under another nonce is replaced: the router's id registry, which makes
# ids unique per tenant across routers, let this one through, so the old one's router is gone.
_ENQUEUE = r"""
local function enqueue_one(A)
  local m, c, cost = A[1], A[2], tonumber(A[3])
  local remaining, nonce = tonumber(A[4]), A[5]
  local mi, mq, tpm, w, max_wait = tonumber(A[6]), tonumber(A[7]), tonumber(A[8]),
                                   tonumber(A[9]), tonumber(A[10])
  local T = tenant_of(m)
  if HOLD > 0 then expire_holds() end
  local rec = redis.call('HMGET', rk(m), 'st', 'n', 'f', 'c')
  if rec[1] == 'q' or rec[1] == 'l' then
    if rec[2] == nonce then                     -- a retried submit: the same answer, nothing counted twice
      if rec[1] == 'l' then return {1, tonumber(rec[3]), 0} end
      return {2, position(m, rec[4]), est_wait((ahead(rec[4])))}
    end
    if rec[1] == 'q' then
      redis.call('HSET', rk(m), 'o', '')
      drop_queued(m, 'replaced')
    else
      end_lease(m, T)
    end
  end
  if not CMAXQ[c] then return {0, 'UNKNOWN_CLASS', 0} end
  set_limits(T, mi, mq, tpm, w)
  -- How long it may wait (for a slot or for its token budget): a request with a deadline, its
  -- remaining time less what serving it takes (a long lease, `set_aside`, at most half the remaining
  -- time; none before 10 leases were seen, as for est_wait); granted later than that, it would
  -- run out of time mid-stream, its tokens wasted.
  local budget_limit = max_wait
  local svc, lg = 0, 0
  if remaining > 0 then
    svc = math.max(set_aside(), 0)
    lg = NOW + remaining - math.min(svc, remaining / 2)     -- = latest_grant(NOW + remaining), stats read once
    budget_limit = math.min(max_wait, math.max(1, lg - NOW))
  end
  local rate_new = 0
  if tpm > 0 then
    if cost > tpm then return {0, 'TOKEN_BUDGET_TOO_SMALL', 0} end
    local queued_cost = tonumber(redis.call('HGET', P .. 'qcost', T) or '0')
    local wait = rate_wait(T, tpm, cost + math.max(queued_cost, 0))
    -- with the mean lease it set aside, so that the router can tell which of the tenant's next
    -- requests would be refused the same way (router_svc/budget_memo.py)
    if wait > budget_limit then return {0, 'TOKEN_RATE_LIMITED/' .. math.floor(svc), math.ceil(wait)} end
    if queued_cost <= 0 then
      local now_wait, new = rate_wait(T, tpm, cost)
      if now_wait == 0 then rate_new = new end
    end
  end
  local n_ahead, n_class = ahead(c)
  local dl = 0
  if remaining > 0 then dl = NOW + remaining end
  -- The fast path: nothing queued in its class or above, room in the pool, the tenant within its
  -- limits: granted without being queued.
  if n_ahead == 0 and (tpm <= 0 or rate_new > 0) and redis.call('ZCARD', P .. 'tl:' .. T) < mi
      and room_for(T, w, c) then
    if tpm > 0 then redis.call('SET', P .. 'tat:' .. T, rate_new, 'PX', 120000) end
    return {1, grant_now(m, T, c, cost, dl, nonce, w), 0}
  end
  local est = -1
  if n_ahead > 0 then est = est_wait(n_ahead) end
  if n_class >= CMAXQ[c] then
    return {0, 'CLASS_QUEUE_FULL', math.max(est, 1000)}
  end
  if est > budget_limit then return {0, 'QUEUE_WAIT_EXCEEDS_DEADLINE', est} end
  local queued_before = tenant_queued(T)
  if rec[1] then redis.call('DEL', rk(m)) end
  insert(m, T, c, cost, dl, ME, nonce, w, lg)
  -- its tenant holds a slot it just freed (it was between requests): the slot is this request's,
  -- though others queued before it
  if HOLD > 0 and redis.call('ZCARD', P .. 'hd:' .. T) > 0 and redis.call('ZCARD', P .. 'tl:' .. T) < mi
      and (tpm <= 0 or rate_new > 0) then
    local s, h = head(c, T)
    if h == m and take_hold(T) then
      if tpm > 0 then redis.call('SET', P .. 'tat:' .. T, rate_new, 'PX', 120000) end
      grant(m, c, T, math.max(s, vtime(c)))
    end
  end
  -- a slot held for its class is the queue's now: the dispatch gives it by the class policy
  if HOLD > 0 and redis.call('HGET', rk(m), 'st') == 'q' then take_hold('#' .. c) end
  dispatch()
  local st = redis.call('HMGET', rk(m), 'st', 'f')
  local reply
  if st[1] == 'l' then
    reply = {1, tonumber(st[2]), 0}
    -- the caller learns its own grant from this reply
    for i = 1, #GRANTS, 3 do
      if GRANTS[i] == m then table.remove(GRANTS, i); table.remove(GRANTS, i); table.remove(GRANTS, i); break end
    end
  elseif queued_before >= mq then                   -- it may not wait: refused, and nothing is left behind
    redis.call('HSET', rk(m), 'o', '')
    drop_queued(m, 'refused')
    if mq == 0 and redis.call('ZCARD', P .. 'tl:' .. T) >= mi then
      return {0, 'TENANT_CONCURRENCY_LIMIT', math.max(est, 100)}
    end
    return {0, 'TENANT_QUEUE_FULL', math.max(est, 100)}
  else
    if est < 0 then est = est_wait((ahead(c))) end
    reply = {2, position(m, c), est}
    -- the tenant's queue is full with it: its next request would be refused (as 'position/full',
    -- so that the router refuses it without asking: router_svc/queue_memo.py)
    if mq > 0 and tenant_queued(T) >= mq then reply[2] = reply[2] .. '/full' end
  end
  return reply
end

local out = {}
local base = 6
for _ = 1, tonumber(ARGV[5]) do
  local A = {}
  for j = 1, 10 do A[j] = ARGV[base + j - 1] end
  local r = enqueue_one(A)
  out[#out + 1] = r[1]; out[#out + 1] = r[2]; out[#out + 1] = r[3]
  base = base + 10
end
for _, g in ipairs(GRANTS) do out[#out + 1] = g end
return out
"""

# Many settlements in one call: ARGV[5] = n, then per lease 5 values: member, fence, actual tokens,
# tokens_per_minute, weight. Reply: per lease {1 settled | 2 its lease had expired (charged,
# capacity already returned) | 3 settled already | 0 stale or unknown}, then the grants of the
# dispatch that follows (once, for all of them).
_SETTLE = r"""
-- Nothing queued in class c or above, and no queued lower class below its minimum share: a request
-- of class c that just ended may keep its slot for its tenant's next one (priority between requests).
local function outranks_queue(c)
  local lower = {}
  for _, cc in ipairs(CLASSES) do
    if redis.call('ZCARD', P .. 'cq:' .. cc) > 0 then
      if RANK[cc] <= RANK[c] then return false end
      lower[#lower + 1] = cc
    end
  end
  return #lower > 0 and at_share(lower)
end

-- Every queued class below c is at its minimum share (and the margin): no hold of class c's may
-- keep a lower class under its floor.
local function lower_at_share(c)
  local lower = {}
  for _, cc in ipairs(CLASSES) do
    if RANK[cc] > RANK[c] and redis.call('ZCARD', P .. 'cq:' .. cc) > 0 then lower[#lower + 1] = cc end
  end
  return #lower == 0 or at_share(lower)
end


local function settle_one(m, fence, actual, tpm, w)
  local rec = redis.call('HMGET', rk(m), 'st', 'f', 'c', 'cost', 'tg', 'seq')
  local T = tenant_of(m)
  local status = 0
  if rec[1] == 's' then status = 3 end           -- settled already (a retry of a settle that did land)
  if rec[1] and rec[2] == fence and (rec[1] == 'l' or rec[1] == 'x') then
    local delta = actual - tonumber(rec[4])
    local fin = tonumber(redis.call('HGET', P .. 'fin:' .. rec[3], T) or '0')
    redis.call('HSET', P .. 'fin:' .. rec[3], T, fin + delta / w)
    charge(T, tpm, delta)
    credit(rec[3], delta, tonumber(rec[6] or '0') > 0)
    if rec[1] == 'l' then
      local st = redis.call('HMGET', P .. 'stats', 'svc', 'n', 'dev')
      local svc = tonumber(st[1] or '0')
      local n = tonumber(st[2] or '0')
      local dev = tonumber(st[3] or '0')
      local took = NOW - tonumber(rec[5])
      if n == 0 then svc, dev = took, 0 else
        dev = dev * 0.9 + math.abs(took - svc) * 0.1
        svc = svc * 0.9 + took * 0.1
      end
      redis.call('HSET', P .. 'stats', 'svc', math.floor(svc), 'n', n + 1, 'dev', math.floor(dev))
      end_lease(m, T)
      if HOLD > 0 and someone_queued() then
        if tenant_queued(T) == 0 and ((under_share(T, w) and lower_at_share(rec[3]))
                                      or outranks_queue(rec[3])) then
          give_hold(T, fence)     -- between requests, below its share or above every queued class
        else
          FREED[#FREED + 1] = fence
        end
      end
      status = 1
    else
      status = 2
    end
    tombstone(m, 's')
  end
  return status
end

if HOLD > 0 then expire_holds() end
local out = {}
local base = 6
for _ = 1, tonumber(ARGV[5]) do
  out[#out + 1] = settle_one(ARGV[base], ARGV[base + 1], tonumber(ARGV[base + 2]), tonumber(ARGV[base + 3]),
                             tonumber(ARGV[base + 4]))
  base = base + 5
end
dispatch()
for _, g in ipairs(GRANTS) do out[#out + 1] = g end
return out
"""

# ARGV[5..]: member, nonce. Reply: {1 removed from the queue | 2 leased (fence follows: settle it) |
#                                   0 unknown, [fence], grants...}
_CANCEL = r"""
local m, nonce = ARGV[5], ARGV[6]
local rec = redis.call('HMGET', rk(m), 'st', 'n', 'f', 'o')
local reply
if rec[1] == 'q' and rec[2] == nonce then
  redis.call('HSET', rk(m), 'o', '')          -- its owner knows
  drop_queued(m, 'cancelled')
  reply = {1, 0}
elseif rec[1] == 'l' and rec[2] == nonce then
  reply = {2, tonumber(rec[3])}
else
  reply = {0, 0}
end
dispatch()
for _, g in ipairs(GRANTS) do reply[#reply + 1] = g end
return reply
"""

# The caller's whole book in one call. ARGV[5] = number of leases, then per lease: member, fence,
# class, cost, max_in_flight, max_queued, tokens_per_minute, weight; then the number of queued,
# then per queued: member, nonce, class, cost, deadline_ms (absolute in the caller's view of
# Redis time, 0 = none), max_in_flight, max_queued, tokens_per_minute, weight.
# A record gone (Redis lost its data) is restored: a lease as held, a queued request queued anew.
# Reply: {depth per class..., then per item: kind, member, value}: kind 'lost' (a lease that
# expired or was fenced off), 'pos' (queued; value = position), 'gone' (value = why),
# followed by the grants (member, fence, why).
_BEAT = r"""
store_cap()
housekeeping()
local out = depths({})
local i = 6
for _ = 1, tonumber(ARGV[5]) do
  local m, fence, c, cost = ARGV[i], ARGV[i + 1], ARGV[i + 2], tonumber(ARGV[i + 3])
  local T = tenant_of(m)
  local rec = redis.call('HMGET', rk(m), 'st', 'f')
  if rec[1] == 'l' and rec[2] == fence then
    redis.call('ZADD', P .. 'leases', 'XX', NOW + TTL, m)
    redis.call('ZADD', P .. 'tl:' .. T, 'XX', NOW + TTL, m)
  elseif not rec[1] then                       -- Redis lost it: the request still runs, count it
    set_limits(T, ARGV[i + 4], ARGV[i + 5], ARGV[i + 6], ARGV[i + 7])
    redis.call('HSET', rk(m), 'st', 'l', 't', T, 'c', c, 'cost', cost, 'S', 0, 'seq', 0, 'dl', 0,
               'o', ME, 'n', '', 'f', fence, 'tg', NOW)
    add_lease(m, T, ARGV[i + 7])
    if tonumber(redis.call('GET', P .. 'fence') or '0') < tonumber(fence) then
      redis.call('SET', P .. 'fence', fence)
    end
  else
    out[#out + 1] = 'lost'; out[#out + 1] = m; out[#out + 1] = 0
  end
  i = i + 8
end
local nq = tonumber(ARGV[i])
i = i + 1
for _ = 1, nq do
  local m, nonce, c, cost, dl = ARGV[i], ARGV[i + 1], ARGV[i + 2], tonumber(ARGV[i + 3]), tonumber(ARGV[i + 4])
  local T = tenant_of(m)
  local rec = redis.call('HMGET', rk(m), 'st', 'n', 'f', 'lg', 'why')
  if rec[1] == 'q' and rec[2] == nonce then
    local exp = NOW + TTL
    local lg = tonumber(rec[4] or '0')
    if lg > 0 and lg < exp then exp = lg end
    redis.call('ZADD', P .. 'qexp', 'XX', exp, m)
    out[#out + 1] = 'pos'; out[#out + 1] = m; out[#out + 1] = position(m, c)
  elseif rec[1] == 'l' and rec[2] == nonce then   -- a grant whose message this router missed
    notify(ME, m, tonumber(rec[3]), 'grant')
  elseif not rec[1] then                          -- Redis lost it: queued again, at the back
    set_limits(T, ARGV[i + 5], ARGV[i + 6], ARGV[i + 7], ARGV[i + 8])
    insert(m, T, c, cost, dl, ME, nonce, tonumber(ARGV[i + 8]))
    out[#out + 1] = 'pos'; out[#out + 1] = m; out[#out + 1] = position(m, c)
  else                                            -- dropped (a tombstone says why) or lost
    out[#out + 1] = 'gone'; out[#out + 1] = m; out[#out + 1] = (rec[1] == 'd' and rec[5]) or 'lost'
  end
  i = i + 9
end
dispatch()
for _, g in ipairs(GRANTS) do out[#out + 1] = g end
return out
"""

# Housekeeping and dispatch only (a router runs it every --reap-interval: expired leases and
# deadlines, budgets that refilled). Reply: {depth per class..., grants...}.
_REAP = r"""
store_cap()
housekeeping()
dispatch()
local out = depths({})
for _, g in ipairs(GRANTS) do out[#out + 1] = g end
return out
"""


# name -> (its body after the prelude, whether it runs when Redis is at maxmemory: the operations that
# settle, cancel and expire free memory and must go on; ENQUEUE is refused before it writes anything)
_BODIES = {"ENQUEUE": (_ENQUEUE, False), "SETTLE": (_SETTLE, True), "CANCEL": (_CANCEL, True),
           "BEAT": (_BEAT, True), "REAP": (_REAP, True)}
ENQUEUE, SETTLE, CANCEL, BEAT, REAP = (
    ("#!lua flags=allow-oom\n" if oom else "#!lua\n") + PRELUDE + body for body, oom in _BODIES.values())


def _library() -> tuple[str, dict[str, str]]:
    """The same operations as one Redis function library (Redis 7: FUNCTION LOAD once, FCALL per
    call): the shared functions are defined once when it loads, not on every call as in the scripts
    above, and the class table is parsed again only when it changes. Its name and its functions'
    names carry a hash of the code, so routers of two versions sharing one Redis each call their own."""
    # the flags too: a function whose flags changed is another function, under another name
    code = _STATE + _FUNCTIONS + "".join(f"{body}{oom}" for body, oom in _BODIES.values())
    tag = hashlib.sha1(code.encode()).hexdigest()[:12]
    names = {op: f"tq_{op.lower()}_{tag}" for op in _BODIES}
    parts = [f"#!lua name=tokenrelay_tq_{tag}\n", "local KEYS, ARGV\n", f"local {_STATE_NAMES}\n",
             "local function setup(keys, argv)\n  KEYS, ARGV = keys, argv\n", _STATE, "end\n", _FUNCTIONS]
    for op, (body, oom) in _BODIES.items():
        flags = "{'allow-oom'}" if oom else "{}"
        parts.append(f"redis.register_function{{function_name='{names[op]}', flags={flags}, "
                     f"callback=function(keys, argv)\nsetup(keys, argv)\n{body}\nend}}\n")
    return "".join(parts), names


LIBRARY, FUNCTIONS = _library()
