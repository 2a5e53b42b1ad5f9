-- The plain handler's request as one fixed request, which wrk builds once and sends without
-- running Lua per request: cheaper for wrk than the other scripts, so a reference only (see
-- scripts/http-bench), never the baseline of a ratio.
function init(args)
  wrk.method = "POST"
  wrk.body = '{"item":"book","quantity":1}'
  wrk.headers["Content-Type"] = "application/json"
end
