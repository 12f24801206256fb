"""The save path (above commit/): staging buffers and snapshots (``staging``), tier choice
(``tiers``), the save modes (``saver``), what a lazy save may defer (``fencing``), file writes
(``writer``), replication to the durable home (``replicator``) and retention with every deletion
(``retention``)."""
