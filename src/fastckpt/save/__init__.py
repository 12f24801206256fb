"""The save path (above commit/): staging buffers and snapshots (``staging``), tier choice
(``tiers``), the save modes (``saver``), file writes (``writer``), replication to the durable
home (``replicator``) and retention with every deletion (``retention``)."""
