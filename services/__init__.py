"""Running Tessera: the `tessera` command (`cli`), the local launcher and the demo-asset builder,
which compose the roles; `services.common` is the ground floor every role stands on."""
