-- Requests cycle through WRK_KEYS keys that an earlier pass completed: each is a replay.
local prefix = os.getenv("WRK_PREFIX") or "replay"
local keys = tonumber(os.getenv("WRK_KEYS") or "1000")
local counter = 0
function init(args)
  wrk.method = "POST"
  wrk.body = '{"item":"book","quantity":1}'
  wrk.headers["Content-Type"] = "application/json"
end
function request()
  counter = counter + 1
  wrk.headers["Idempotency-Key"] = prefix .. "-" .. tostring(counter % keys)
  return wrk.format()
end
function done(summary, latency, requests)
end
