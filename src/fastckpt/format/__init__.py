"""The file format (the lowest layer; imports nothing else of fastckpt but errors): how a state
becomes a torch.save-compatible file image (``layout``), the manifest in its zip comment
(``manifest``), and the checksum (``checksum``). See docs/format.md."""
