-- Every request carries a fresh Idempotency-Key: a first execution behind the layer; the plain
-- handler gets the same requests (its route ignores the key), so wrk does the same work for both.
-- A per-run prefix (WRK_PREFIX) keeps runs apart; wrk's threads each get their own counter.
local prefix = os.getenv("WRK_PREFIX") or tostring(os.time())
local thread_id = 0
local counter = 0
function setup(thread)
  thread_id = thread_id + 1
  thread:set("tid", thread_id)
end
function init(args)
  wrk.method = "POST"
  wrk.body = '{"item":"book","quantity":1}'
  wrk.headers["Content-Type"] = "application/json"
end
function request()
  counter = counter + 1
  wrk.headers["Idempotency-Key"] = prefix .. "-" .. tostring(tid) .. "-" .. tostring(counter)
  return wrk.format()
end
