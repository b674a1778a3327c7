"""The live dashboard: `berth dashboard --nats URL` (and `berth up`, which starts it).

Two halves, both small:

- `live.py`, the bus side: a NATS *client* (never a service) that keeps what the page shows:
  service instances (`$SRV.STATS`), nodes with capacity and usage per plugin (`list-nodes`, paged,
  then re-read node by node on their `events.resource.<node>.*`), warm pools (`list-brokers`, re-read
  on `events.broker.>`), the latest events, and a few metrics of each metrics agent (a
  `register-notifier` lease per metric, renewed, and the agent's change events: `charts.py`). Every
  change is pushed to the browsers as a server-sent event (`views.py` shapes what the page draws,
  `feed.py` queues it for each open page).
- `app.py`, the web side: a Starlette app serving `static/` (plain HTML, CSS and ES modules; the
  charts are hand-written SVG), the snapshot at `/api/state` and the stream at `/api/stream`.
"""
