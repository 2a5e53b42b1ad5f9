-- The plain handler: the same request without a key.
function init(args)
  wrk.method = "POST"
  wrk.body = '{"item":"book","quantity":1}'
  wrk.headers["Content-Type"] = "application/json"
end
