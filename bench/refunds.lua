-- wrk script for bench/refunds.py: every request a refund on a payment of its own, under its
-- client's agent key, with a fresh Idempotency-Key. Arguments: plan file, "full" or "floor",
-- wrk's thread count, a nonce for this run. Each plan line is "key client payment"; thread n
-- takes every line whose index is n modulo the thread count.

local threads, created = {}, 0

function setup(thread)
  thread:set("id", created)
  created = created + 1
  table.insert(threads, thread)
end

function init(args)
  local plan, mode, nthreads = args[1], args[2], tonumber(args[3])
  nonce, want_approved = args[4], mode == "full"
  rows, sent, ok, exhausted, errors = {}, 0, 0, 0, {}
  local i = 0
  for line in io.lines(plan) do
    if i % nthreads == id then
      local key, client, payment = line:match("(%S+) (%S+) (%S+)")
      rows[#rows + 1] = {key, client, payment}
    end
    i = i + 1
  end
end

function request()
  sent = sent + 1
  if sent > #rows then exhausted = exhausted + 1 end  -- the run is void; the driver says so
  local row = rows[(sent - 1) % #rows + 1]
  local body = string.format('{"transaction_id":"%s","amount":500,"reason":"customer_request",' ..
                             '"agent":{"session_id":"bench-%s","model":"bench"}}', row[3], row[2])
  return wrk.format("POST", "/api/v1/refunds", {["Authorization"] = "Bearer " .. row[1],
    ["Content-Type"] = "application/json", ["Idempotency-Key"] = nonce .. "-" .. id .. "-" .. sent}, body)
end

function response(status, headers, body)
  if status == 201 and (not want_approved or body:find('"status":"approved"', 1, true)) then
    ok = ok + 1
  else
    local what = status .. " " .. body:sub(1, 120):gsub("%s+", " ")
    errors[what] = (errors[what] or 0) + 1
  end
end

-- Machine-readable for the driver: totals, errors, and the latency (µs) at each percentile, in
-- steps of 0.5 and of 0.1 from 98 on, so the driver can pool rounds.
function done(summary, latency, requests)
  local ok_all, exhausted_all = 0, 0
  for _, thread in ipairs(threads) do
    ok_all = ok_all + thread:get("ok")
    exhausted_all = exhausted_all + thread:get("exhausted")
    for what, n in pairs(thread:get("errors")) do io.write(string.format("error\t%d\t%s\n", n, what)) end
  end
  io.write(string.format("total\t%d\t%d\t%d\n", summary.duration, ok_all, exhausted_all))
  local p = 0.5
  while p <= 100.001 do
    io.write(string.format("quantile\t%.1f\t%d\n", p, latency:percentile(p)))
    p = p + (p < 97.99 and 0.5 or 0.1)
  end
end
