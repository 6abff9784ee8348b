"""The HTTP server's shared parts: the app that mounts every protocol's routes, body reading and limits,
the guard against abusive clients, common responses and the utility routes (health, metrics, models)."""
