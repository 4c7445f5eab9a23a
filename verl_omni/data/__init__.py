"""Data contracts: GN0 collections, occupancy scenes, converted Parquet rows, video frame access."""
