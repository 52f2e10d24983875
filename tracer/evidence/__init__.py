"""What the serving stack says about itself: ``poller`` scrapes engine and router
metrics, ``engines`` knows which figures are live and which move at request finish,
``probes`` asks over fresh connections on a stall, ``topology`` fingerprints what is
upstream of a tap, ``options`` are the command-line options they share."""
