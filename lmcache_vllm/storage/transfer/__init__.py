"""The transfer between instances: one instance pulls chunks another holds in its L1, over TCP.

Used by disaggregated prefill (a decode instance pulls what a prefill instance computed) and shared by
anything else that moves chunks between instances. `wire` is the message format (framed, bounded, no
pickle), `server` the endpoint that serves held chunks (`sockets`: its socket helpers), `holds` what the
serving side keeps pinned for a puller and for how long, `client` the puller (`PeerTier`, a read-only tier)
and its RELEASE sender.
"""
