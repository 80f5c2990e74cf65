-- wrk driver for the HTTP floor: GET /health, the cheapest request this server answers.
wrk.method = "GET"
wrk.path = "/health"

done = dofile("scripts/load/report.lua")
