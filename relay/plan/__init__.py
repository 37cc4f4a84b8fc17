"""resolve(): config, request and host facts in, one frozen Plan out (the one composer of policy and render)."""
