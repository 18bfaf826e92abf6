use boostr_runtime::attention;

#[attention(score = |s, _b, _h, _q, _kv| s, tile(rows = 64))]
#[derive(Clone, Debug)]
struct UnknownTileKey;

fn main() {}
