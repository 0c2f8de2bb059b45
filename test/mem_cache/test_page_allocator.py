import pytest

from sgl_jax.mem_cache.page_allocator import NULL_PAGE, OutOfPagesError, PageAllocator


def test_null_page_is_never_handed_out():
    allocator = PageAllocator(5)
    pages = allocator.allocate(4)
    assert sorted(pages) == [1, 2, 3, 4] and NULL_PAGE not in pages
    assert allocator.num_free == 0


def test_free_returns_pages_and_they_are_reused():
    allocator = PageAllocator(8)
    first = allocator.allocate(3)
    allocator.free(first)
    assert allocator.num_free == allocator.capacity == 7
    assert set(allocator.allocate(7)) == set(range(1, 8))


def test_out_of_pages_names_the_numbers_and_allocates_nothing():
    allocator = PageAllocator(4)
    with pytest.raises(OutOfPagesError, match="need 4 KV pages but only 3 are free"):
        allocator.allocate(4)
    assert allocator.num_free == 3


def test_double_free_is_an_error():
    allocator = PageAllocator(4)
    pages = allocator.allocate(2)
    allocator.free(pages)
    with pytest.raises(ValueError, match="not allocated"):
        allocator.free(pages[:1])


def test_pool_needs_two_pages():
    with pytest.raises(ValueError, match="at least 2 pages"):
        PageAllocator(1)
