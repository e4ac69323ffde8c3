"""Bytes on a link: frames, the expert RPC's messages and their coding, byte counts, the direct lane, a WAN emulator."""
