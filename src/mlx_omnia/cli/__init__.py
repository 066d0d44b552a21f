"""`omnia`: the command-line client of omnia-server (chat, run, models, pull, status).

It talks to the server over HTTP only and never imports MLX or the engine, so it starts fast;
when nothing answers on the default loopback URL it starts omnia-server in the background."""
