"""Reading weights safely: tensor records and byte ranges, nothing imported or called."""
