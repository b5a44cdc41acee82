//! docs/src/format.md's worked byte example, checked byte for byte on every backend.

use rotkv::paged::LayerShape;
use rotkv::{CacheConfig, Rotation};
use rotkv_tests::{Store, backends};

#[test]
fn worked_example_of_format_md() {
    let config = CacheConfig {
        head_dim: 64,
        key_bits: 2,
        value_bits: 2,
        group_size: 32,
        page_size: 16,
        sinks: 0,
        window: 0,
        key_rotation: Rotation::None,
        value_rotation: Rotation::None,
        key_clip: 1.0,
        value_clip: 1.0,
        protected: 0,
        channel_norm: 0,
    };
    let fmt = config.format().unwrap();
    assert_eq!(fmt.page_bytes(), 768);
    assert_eq!((fmt.scale_at(false, 0, 0), fmt.scale_at(true, 0, 0)), (512, 640));
    let key: Vec<f32> = (0..64).map(|c| if c < 32 { 0.5 * (c % 4) as f32 - 0.25 } else { 1.0 }).collect();
    // 16 tokens fill one page (no sinks, no window); the example token is slot 0.
    let k: Vec<f32> = (0..16).flat_map(|_| key.iter().copied()).collect();
    let v = k.clone();
    for backend in backends() {
        let mut st = Store::new(config, LayerShape { num_kv_heads: 1, num_q_heads: 1 }, 16, None);
        st.append(backend, &k, &v).unwrap();
        let page = &st.pool.bytes()[..768];
        assert_eq!(&page[0..8], &[0xE4; 8], "{backend:?}");
        assert_eq!(&page[8..16], &[0; 8]);
        assert_eq!(&page[512..514], &[0x00, 0x38]);
        assert_eq!(&page[544..546], &[0x00, 0x00]);
        assert_eq!(&page[576..578], &[0x00, 0xB4]);
        assert_eq!(&page[608..610], &[0x00, 0x3C]);
        let word = u32::from_le_bytes(page[0..4].try_into().unwrap());
        assert_eq!(word, 0xE4E4_E4E4);
        assert!((0..16).all(|k| (word >> (2 * k)) & 3 == k % 4));
    }
}
