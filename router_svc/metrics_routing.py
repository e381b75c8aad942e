"""Router metrics of placement: decision time, session moves, migrations, the prefix index's feeds."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

ROUTE_SECONDS = Histogram(
    "tokenrelay_router_route_seconds", "Time to place a request on a replica (prompt block keys, index lookup, "
    "policy), per attempt", ["policy"],
    buckets=(0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1))
ROUTED = Counter("tokenrelay_router_routed_total", "Placements by policy and by whether the chosen replica was "
                 "believed to hold part of the prompt (hit) or not (miss)", ["policy", "prefix"])
SESSION_MOVES = Counter("tokenrelay_router_session_moves_total", "Sessions moved off their replica, by why: gone "
                        "(no longer a replica), unavailable (unhealthy or draining), saturated, retry (it failed "
                        "this request)", ["reason"])
MIGRATIONS = Counter("tokenrelay_router_migrations_total", "Requests moved to another replica after their first "
                     "token, by the failure's reason", ["reason"])
KV_EVENT_GAPS = Counter("tokenrelay_router_kv_event_gaps_total", "KV-event streams restarted after a gap in event "
                        "ids or dropped events (the replica's index entry is rebuilt from a snapshot)", ["replica"])
KV_EVENT_FEEDS = Gauge("tokenrelay_router_kv_event_feeds", "Engine replicas by KV-event feed state: live (events), "
                       "history (the engine publishes none: routing history), down (reconnecting)", ["state"])
KV_EVENTS = Counter("tokenrelay_router_kv_events_total", "KV-cache events applied to the prefix index", ["type"])
PLACEMENT_SHARE = Counter("tokenrelay_router_placement_share_total", "Placement records shared with the other "
                          "router processes (router_svc/placement_share.py), by event: sent, received, dropped "
                          "(buffer full), alone (not sent: no other router listens), publish_failed (Redis down "
                          "or slow), bad_message", ["event"])
PLACEMENT_SHARE_SUBSCRIBED = Gauge("tokenrelay_router_placement_share_subscribed", "1 while this router hears "
                                   "the other routers' placements (subscribed to the pool's channel), else 0")
